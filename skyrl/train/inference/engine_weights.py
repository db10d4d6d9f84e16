"""The engine client's weight updates, three paths behind one version counter (`EngineWeights`, mixed
into `InferenceEngineClient`):
- object store (`update_weights`): the named tensors are `ray.put` once and every
  engine fetches them, validates the update, loads it and resets its prefix cache.
- broadcast (`init_weight_sync`, `broadcast_weights`): the engines join a process
  group with the policy's rank 0 (NCCL on GPU, gloo on CPU; see `weight_sync`),
  check the spec of the update, then receive it group by group.
- shared memory (`share_weights`, colocated engines): the engines check the spec,
  then each policy rank hands its engine one group at a time through CUDA IPC or
  /dev/shm (see `shared_weights`).
Each way the client's `weight_version` advances once every engine has the update.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import ray
import torch
from ray.actor import ActorHandle

from skyrl.train.inference.weight_sync import WeightSyncGroup
from skyrl.train.inference.weights import StreamSpec


class EngineWeights:
    """Weight updates to every engine of the client it is mixed into. The client provides `engines`,
    `num_engines`, `_call(index, method, *args)` and `_call_all(method, *args, revive=...)`; these
    methods keep `_weight_version`, `_latest_weights` (the last object-store update: a restarted engine
    gets it), `_in_sync_group` and read `_ranks_per_engine` (engine ranks in a broadcast group)."""

    engines: tuple[ActorHandle, ...]
    num_engines: int
    _weight_version: int
    _latest_weights: ray.ObjectRef | None
    _in_sync_group: bool
    _ranks_per_engine: int

    def _check_version(self, version: int, resend: bool = False) -> None:
        if resend:  # the current weights again, e.g. to a restarted engine
            if version != self._weight_version:
                raise ValueError(
                    f"a resend carries the current weight version {self._weight_version}, not {version}."
                )
            return
        if version <= self._weight_version:
            raise ValueError(
                f"weight version {version} must be greater than the current {self._weight_version}."
            )

    async def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | ray.ObjectRef, version: int
    ) -> None:
        """Push weights to every engine: put once in the object store (or pass a ref to CPU tensors
        already there), each engine fetches, validates, loads and resets its prefix cache. `version`
        must exceed `weight_version`, which becomes `version` once all engines accepted. A bad update
        raises `WeightUpdateError` from the engines and changes nothing. A dead engine is restarted and
        updated like in `generate`; so are those found dead by `sleep`, `wake_up` and `reset_prefix_cache`."""
        self._check_version(version)
        if isinstance(named_tensors, ray.ObjectRef):
            ref = named_tensors
        else:
            ref = ray.put({name: t.detach().cpu() for name, t in named_tensors.items()})
        await self._call_all(
            "update_weights", ref, version, revive=True
        )  # a restart loads the old, then this
        self._weight_version = version
        self._latest_weights = ref

    @property
    def weight_sync_world_size(self) -> int:
        """Ranks of the broadcast weight-sync group: the sender (rank 0) and every engine worker."""
        return 1 + self.num_engines * self._ranks_per_engine

    async def init_weight_sync(
        self, group: WeightSyncGroup, join_sender: Callable[[], Awaitable[Any]]
    ) -> None:
        """Every engine joins `group` (ranks 1..) while `join_sender()` makes the sender join as rank 0
        (all ranks must join together). `group.world_size` must be `weight_sync_world_size`."""
        if group.world_size != self.weight_sync_world_size:
            raise ValueError(
                f"a weight-sync group of {group.world_size} ranks; this client's engines and the sender need "
                f"{self.weight_sync_world_size} (client.weight_sync_world_size)."
            )
        joins = [
            self._call(i, "init_weight_sync", group, 1 + i * self._ranks_per_engine)
            for i in range(self.num_engines)
        ]
        await gather(join_sender(), *joins)
        self._in_sync_group = True

    async def broadcast_weights(
        self, spec: StreamSpec, version: int, send: Callable[[], Awaitable[Any]], resend: bool = False
    ) -> None:
        """Weight sync by broadcast: every engine checks `spec` (a bad update raises `WeightUpdateError`
        and nothing is sent; a dead engine is restarted first, see `restart_engine`), then `send()`
        broadcasts the groups of `spec` in order while every engine receives and loads them. `version`
        as in `update_weights`; with `resend`, the current version (the same weights again)."""
        self._check_version(version, resend)
        if not self._in_sync_group:
            raise RuntimeError(
                "the engines have not joined a weight-sync group; call init_weight_sync first."
            )
        await self._call_all("check_weight_spec", spec, revive=not resend)
        await gather(send(), self._call_all("receive_weights", spec, version))
        self._weight_version = version
        self._latest_weights = None

    async def share_weights(
        self,
        spec: StreamSpec,
        version: int,
        send: Callable[[tuple[ActorHandle, ...]], Awaitable[Any]],
        resend: bool = False,
    ) -> None:
        """Weight sync through shared memory, for engines on their sender's node (and GPU): every engine
        checks `spec` (a bad update raises `WeightUpdateError` and nothing is sent; a dead engine is
        restarted first, see `restart_engine`), then `send(engines)` hands the groups of `spec` to the
        engines with `load_shared_weights`, the last group of each with `version` (e.g.
        `FSDPWorker.share_weights` on every policy rank). `version` and `resend` as in `broadcast_weights`."""
        self._check_version(version, resend)
        await self._call_all("check_weight_spec", spec, revive=not resend)
        await send(self.engines)
        self._weight_version = version
        self._latest_weights = None


async def gather(*awaitables: Awaitable[Any]) -> list[Any]:
    """Await all, then raise the first error (no call is left running behind an early failure)."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
