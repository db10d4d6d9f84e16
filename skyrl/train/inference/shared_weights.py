"""Weight sync through shared memory, for engines colocated with the policy (`weight_sync=ipc`).

Colocated, engine i shares policy rank i's bundle: the same node and, on GPU, the
same device. The rank packs one weight group (a decoder layer, then the rest)
into a byte buffer it owns and hands the engine a handle to it: a CUDA IPC handle
on GPU, the name of a /dev/shm file on CPU. The engine maps the buffer, loads the
group from it and returns; only then does the rank refill the buffer with the
next group. Tensors are never serialised and no process group is needed, so this
works where NCCL cannot (two processes on one GPU).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

ALIGN_BYTES = 64  # every tensor starts at a multiple of this, so any dtype can view its bytes
SHM_DIR = "/dev/shm"
_DEVICE_ARG = 6  # index of the device in `reduce_tensor`'s arguments for a CUDA tensor


class SharedWeightsError(RuntimeError):
    """Shared weights cannot be mapped here: another node, another GPU, or no room in /dev/shm."""


@dataclass(frozen=True)
class SharedGroup:
    """A handle to one weight group in a sender's buffer: where the buffer lives (`host`, and the
    UUID of its `gpu`, None on CPU), how to map it (`handle`), and each tensor's
    (name, dtype name, shape, byte offset)."""

    host: str
    gpu: str | None
    handle: tuple[Any, ...]
    layout: tuple[tuple[str, str, tuple[int, ...], int], ...]

    def spec(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """The group's (name, dtype name, shape) triples, as in a `StreamSpec` group."""
        return [(name, dtype, shape) for name, dtype, shape, _ in self.layout]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def packed_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes a buffer needs to hold `tensors` (tensors or meta tensors) packed by `SharedBuffer.share`."""
    return sum(_aligned(t.numel() * t.element_size()) for t in tensors)


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _check_shm_room(nbytes: int) -> None:
    stat = os.statvfs(SHM_DIR)
    free = stat.f_bavail * stat.f_frsize
    if nbytes > free:
        raise SharedWeightsError(
            f"weight_sync=ipc on CPU needs {nbytes / 2**20:.0f} MiB free in {SHM_DIR} for the largest weight "
            f"group; {free / 2**20:.0f} MiB are free. Enlarge it (docker run --shm-size=...) or set "
            "generator.inference_engine.weight_sync=object_store."
        )


class SharedBuffer:
    """The sender's side: a byte buffer of `nbytes` on `device` that other processes on this node can map.

    On GPU it is ordinary device memory exported by CUDA IPC; on CPU it lives in /dev/shm. `close`
    releases it once the receivers are done.
    """

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes = nbytes
        if device.type == "cuda":
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._gpu: str | None = _gpu_uuid(self._buffer.device.index)
        else:
            _check_shm_room(nbytes)
            storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)
            self._buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
            self._gpu = None
            self._cpu_handle = storage._share_filename_cpu_()

    def share(self, tensors: Mapping[str, torch.Tensor]) -> SharedGroup:
        """Copy `tensors` into the buffer and return a handle to them; the handle of the previous
        group is invalid from now on."""
        layout, offset = [], 0
        for name, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            if offset + nbytes > self.nbytes:
                raise ValueError(
                    f"the weight group does not fit a shared buffer of {self.nbytes} bytes (at {name}); "
                    "size it with packed_nbytes of the largest group."
                )
            self._buffer[offset : offset + nbytes].copy_(tensor.detach().reshape(-1).view(torch.uint8))
            layout.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
            offset += _aligned(nbytes)
        if self._gpu is None:
            handle = self._cpu_handle
        else:
            torch.cuda.synchronize(self._buffer.device)  # the receiver reads on its own stream
            # a fresh export per group: each carries its own reference count for the receiver to release
            handle = reduce_tensor(self._buffer)[1]
        return SharedGroup(socket.gethostname(), self._gpu, handle, tuple(layout))

    def close(self) -> None:
        """Release the buffer (receivers must have returned from loading)."""
        on_gpu = self._gpu is not None
        del self._buffer
        if on_gpu:
            torch.cuda.ipc_collect()


def open_shared(group: SharedGroup) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of `group`, mapped from the sender's buffer without a copy. They are
    valid until the sender shares its next group: load (copy) them, do not keep them."""
    if group.host != socket.gethostname():
        raise SharedWeightsError(
            f"shared weights come from host {group.host!r}, but this engine runs on {socket.gethostname()!r}; "
            "weight_sync=ipc needs each engine on its policy rank's node (trainer.placement.colocate_all=true)."
        )
    if group.gpu is None:
        storage = torch.UntypedStorage._new_shared_filename_cpu(*group.handle)
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
    else:
        args = list(group.handle)
        args[_DEVICE_ARG] = _local_gpu(group.gpu)
        buffer = rebuild_cuda_tensor(*args)
    tensors = []
    for name, dtype, shape, offset in group.layout:
        dt = getattr(torch, dtype)
        nbytes = torch.Size(shape).numel() * dt.itemsize
        tensors.append((name, buffer[offset : offset + nbytes].view(dt).view(shape)))
    return tensors


def _local_gpu(uuid: str) -> int:
    """This process's index of the GPU with `uuid`; `SharedWeightsError` if it cannot see that GPU."""
    visible = [_gpu_uuid(i) for i in range(torch.cuda.device_count())]
    if uuid not in visible:
        raise SharedWeightsError(
            f"shared weights live on GPU {uuid}, which this engine cannot see (it sees {visible}); "
            "weight_sync=ipc needs each engine on its policy rank's GPU (trainer.placement.colocate_all=true)."
        )
    return visible.index(uuid)


def send_shared(
    engine: Any,
    groups: Iterable[Mapping[str, torch.Tensor]],
    nbytes: int,
    device: torch.device,
    version: int,
) -> None:
    """Hand `groups` one at a time to `engine` (a Ray actor handle to an `InferenceEngine`) through one
    shared buffer of `nbytes` on `device`, waiting for each load; the last group carries `version`."""
    import ray  # here only: mapping and sharing buffers needs no Ray

    buffer = SharedBuffer(nbytes, device)
    try:
        pending = None
        for group in groups:
            if pending is not None:
                ray.get(engine.load_shared_weights.remote(pending, None))
            pending = buffer.share(group)  # the previous group is loaded: its bytes may be overwritten
        if pending is not None:
            ray.get(engine.load_shared_weights.remote(pending, version))
    finally:
        buffer.close()
