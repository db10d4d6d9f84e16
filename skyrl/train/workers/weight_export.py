"""A worker's weights as the engines take them: a full state dict, the LoRA adapters, or one group at
a time for the streaming paths (broadcast to a sync group, shared memory to colocated engines).

Engines take the checkpoint's parameter names, adapters merged (base + alpha / rank * B @ A), in
their own dtype when one is given (fp32 master weights sent to a bf16 engine would cost twice the
bytes). The streaming paths send one decoder layer at a time, so fused engine weights (q/k/v,
gate/up) arrive together. Every function that gathers is collective: each rank of the group calls it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from skyrl.train.workers.lora import adapter_tensors, is_adapter_name, merge_adapters

if TYPE_CHECKING:  # the weight-sync helpers import Ray: a worker loads them only when it syncs
    from skyrl.train.inference.weight_sync import WeightSyncGroup
    from skyrl.train.inference.weights import StreamSpec
    from skyrl.train.workers.fsdp_worker import FSDPWorker


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from its shards (a DTensor), or a copy of an unsharded one (never a view
    of live weights)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def gathered(worker: FSDPWorker, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Whole copies of the named parameters, on CPU (collective: every rank, the same names)."""
    params = dict(worker.model.named_parameters())
    return {name: whole(params[name]).detach().cpu() for name in names}


def full_state_dict(worker: FSDPWorker, dtype: str | None = None) -> dict[str, torch.Tensor] | None:
    """The whole model on rank 0, on CPU, as engines take it; None elsewhere (collective)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(worker.model, options=options)
    if worker.rank != 0:
        return None
    if not worker.sharded:  # the live parameters themselves: copies, as FSDP's gather makes
        state = {name: t.clone() for name, t in state.items()}
    return _for_engines(worker, state, dtype)


def adapter_state_dict(worker: FSDPWorker, scaled: bool = True) -> dict[str, torch.Tensor] | None:
    """LoRA only: the adapters on rank 0, on CPU, as `<module>.lora_A.weight` / `.lora_B.weight`, B times
    alpha / rank when `scaled` (what engines load; see `inference.weights`); None elsewhere (collective).
    Only the adapters are gathered."""
    state = gathered(worker, (name for name, _ in worker.model.named_parameters() if is_adapter_name(name)))
    if worker.rank != 0:
        return None
    return adapter_tensors(state, worker.lora_scaling if scaled else 1.0)


def sync_nbytes(worker: FSDPWorker, adapters: bool, dtype: str | None = None) -> int:
    """Bytes one weight sync sends each engine: the LoRA adapters (`adapters`), or the (merged) weights in
    `dtype` (default: the worker's)."""
    if adapters:
        tensors = [p for name, p in worker.model.named_parameters() if is_adapter_name(name)]
    else:
        tensors = [t for group in _groups_meta(worker, dtype) for t in group.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def iter_weight_groups(worker: FSDPWorker, dtype: str | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Full weights one decoder layer at a time (then the rest), as engines take them; collective: every
    rank iterates, and the tensors are complete on every rank."""
    for params in _param_groups(worker):
        yield _for_engines(worker, {name: whole(p) for name, p in params.items()}, dtype)


def weight_stream_spec(worker: FSDPWorker, dtype: str | None = None) -> StreamSpec:
    """What `broadcast_weights` and `share_weights` send in `dtype`, in order (full shapes; no
    communication)."""
    from skyrl.train.inference.weights import stream_spec

    return stream_spec(_groups_meta(worker, dtype))


def init_weight_sync(worker: FSDPWorker, group: WeightSyncGroup) -> None:
    """Rank 0 joins the engines' weight-sync group as its sender (rank 0); other ranks do nothing."""
    from skyrl.train.inference.weight_sync import init_sync_group, sync_device

    if worker.rank == 0:
        worker.sync_group = init_sync_group(group, 0)
        worker.sync_device = sync_device(group.backend)  # NCCL sends CUDA tensors (cpu_offload: copies)


def broadcast_weights(worker: FSDPWorker, dtype: str | None = None) -> None:
    """Gather one weight group at a time (in `dtype` when given); rank 0 broadcasts it to the engines'
    sync group (collective)."""
    from skyrl.train.inference.weight_sync import send_group

    for group in iter_weight_groups(worker, dtype):
        if worker.rank == 0:
            send_group(worker.sync_group, (t.to(worker.sync_device) for t in group.values()))


def share_weights(worker: FSDPWorker, engines: Sequence[Any], version: int, dtype: str | None = None) -> None:
    """Gather one weight group at a time (in `dtype` when given); rank i hands it to `engines[i]` (colocated
    on its bundle) through shared memory and waits until it is loaded (see `shared_weights`); the last
    group carries `version`. Ranks without an engine only gather (collective). The buffer is on the
    rank's device (CUDA IPC on GPU, also with cpu_offload)."""
    from skyrl.train.inference.shared_weights import packed_nbytes, send_shared

    groups = iter_weight_groups(worker, dtype)
    try:
        if worker.rank < len(engines):
            nbytes = max(packed_nbytes(g.values()) for g in _groups_meta(worker, dtype))
            send_shared(engines[worker.rank], groups, nbytes, worker.device, version)
    finally:
        for _ in groups:  # after a failure too: the other ranks are in the same collectives
            pass


def _param_groups(worker: FSDPWorker) -> list[dict[str, torch.Tensor]]:
    """The weights by decoder layer, then the rest; from the state dict, not `named_parameters`: a tied
    lm_head must travel under its own name too."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in worker.model.state_dict().items():
        parts = name.split(".")
        key = ".".join(parts[:3]) if parts[:2] == ["model", "layers"] else "other"
        groups.setdefault(key, {})[name] = param
    return list(groups.values())


def _for_engines(
    worker: FSDPWorker, group: dict[str, torch.Tensor], dtype: str | None
) -> dict[str, torch.Tensor]:
    """A weight group as engines take it: adapters merged (LoRA), in `dtype` when given."""
    group = merge_adapters(group, worker.lora_scaling) if worker.lora is not None else group
    return {name: t.to(getattr(torch, dtype)) for name, t in group.items()} if dtype else group


def _groups_meta(worker: FSDPWorker, dtype: str | None = None) -> list[dict[str, torch.Tensor]]:
    """What `iter_weight_groups(worker, dtype)` yields, as meta tensors (names, shapes, dtypes; no
    communication)."""
    return [
        _for_engines(
            worker, {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in g.items()}, dtype
        )
        for g in _param_groups(worker)
    ]
