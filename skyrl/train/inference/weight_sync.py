"""Weight sync by collective broadcast: policy rank 0 sends, every engine worker receives.

One process group, outside the trainer's own, joins the policy's rank 0 (rank 0)
with the workers of every engine (ranks 1..): NCCL between GPUs, gloo on CPU,
the same code. Weights travel one group at a time (a decoder layer, then the
rest), so fused engine weights (q/k/v, gate/up) arrive together and an engine
never holds more than one extra layer. The driver sends the `StreamSpec` (names,
dtypes, shapes, in sending order) first; engines check it against their model,
and only then does the broadcast start, so a bad update changes nothing.

NCCL cannot join two ranks on one GPU: colocated GPU runs use `shared_weights` (CUDA IPC).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class WeightSyncGroup:
    """How to join the weight-sync process group: rank 0 (the sender) hosts the rendezvous store at
    `master_addr:master_port`; `backend` is `gloo` or `nccl`; a rank waits `timeout_s` for the others."""

    master_addr: str
    master_port: int
    world_size: int
    backend: str
    timeout_s: float

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"weight sync backend {self.backend!r} is not one of {list(BACKENDS)}")


def init_sync_group(group: WeightSyncGroup, rank: int) -> dist.ProcessGroup:
    """Join `group` as `rank`; blocks until every rank joined."""
    timeout = datetime.timedelta(seconds=group.timeout_s)
    store = dist.TCPStore(
        group.master_addr, group.master_port, group.world_size, is_master=rank == 0, timeout=timeout
    )
    if group.backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, group.world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, group.world_size, options)


def send_group(group: dist.ProcessGroup, tensors: Iterable[torch.Tensor]) -> None:
    """Broadcast `tensors` from rank 0, in order."""
    for tensor in tensors:
        group.broadcast(tensor.contiguous(), 0).wait()


def receive_group(
    group: dist.ProcessGroup, spec: Sequence[tuple[str, str, tuple[int, ...]]], device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """Receive one weight group broadcast by rank 0, as (name, tensor) pairs on `device`."""
    received = []
    for name, dtype, shape in spec:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        group.broadcast(tensor, 0).wait()
        received.append((name, tensor))
    return received


def sync_device(backend: str) -> torch.device:
    """Where received tensors live: the current GPU for NCCL, the CPU for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
