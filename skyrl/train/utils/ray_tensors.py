"""CPU tensors through Ray as their raw bytes.

Ray pickles a `torch.Tensor` the way `torch.save` does: every tensor's storage goes through its own
`torch.load` on arrival, ~60 us each, and a view carries its whole storage. Batches travel as many
small tensors (a `TensorList` holds one per row), so that is milliseconds a step. As bytes (a uint8
numpy array: pickle 5 passes it out of band, without a copy) a tensor costs a few microseconds and
carries only its own elements. The receiver gets a tensor of its own (a copy, writable), with the
sender's dtype and shape; the reverse of a view's sharing is not kept, which nothing sends across
processes. Other tensors (on an accelerator, needing grad, sparse, nested, quantized, complex, with
the negative bit) go as before.
"""

from __future__ import annotations

import io

import numpy as np
import torch


def _plain(tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not (
            tensor.requires_grad
            or tensor.is_quantized
            or tensor.is_complex()
            or tensor.is_nested
            or tensor.is_neg()
        )
    )


def _serialize(tensor: torch.Tensor) -> tuple:
    if _plain(tensor):
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        return data, tensor.dtype, tuple(tensor.shape)
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return (buffer.getvalue(),)


def _deserialize(parts: tuple) -> torch.Tensor:
    if len(parts) == 1:
        return torch.load(io.BytesIO(parts[0]), weights_only=False)
    data, dtype, shape = parts
    tensor = torch.empty(shape, dtype=dtype)
    np.copyto(tensor.reshape(-1).view(torch.uint8).numpy(), data)  # `data` may be read-only shared memory
    return tensor


def register_tensor_serializer() -> None:
    """Send this process's CPU tensors through Ray as bytes (see the module docstring); any process
    deserializes them. Idempotent; call it in every process that sends tensors, after `ray.init`."""
    import ray

    ray.util.register_serializer(torch.Tensor, serializer=_serialize, deserializer=_deserialize)
