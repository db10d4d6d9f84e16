"""Ray actor groups on placement groups: N workers with ranks, a world size and a rendezvous.

Colocated layout: several groups (policy, reference, engines) share one placement
group, each actor taking a fraction of a bundle. Disaggregated: each group gets
its own placement group. Multi-node needs nothing more than a Ray cluster
(`ray start --head` / `ray start --address`): bundles land on whichever nodes
have the resources.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

import psutil
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from skyrl.train.schema import TrainerConfig
from skyrl.train.training_batch import TrainingInputBatch
from skyrl.train.utils.ray_tensors import register_tensor_serializer
from skyrl.train.workers.dispatch import MeshDispatch, StagedMiniBatch
from skyrl.train.workers.fsdp_worker import FSDPWorker

PIN_TIMEOUT_S = 60.0  # the longest pinning an idle actor to its cores may take
DEATH_POLL_S = 2.0  # while some ranks of a call have finished, how often the others' liveness is checked


class WorkerDiedError(RuntimeError):
    """A training worker's process died (killed, OOM, crashed); its group's collectives are broken, so
    the group must be rebuilt (the trainer does, from the last complete checkpoint, `trainer.max_restarts`)."""

    def __init__(self, role: str, ranks: list[int], method: str, cause: str):
        super().__init__(f"{role} worker rank(s) {ranks} died during {method}: {cause}")
        self.role, self.ranks, self.method, self.cause = role, ranks, method, cause


def create_placement_group(
    num_bundles: int, cpus_per_bundle: float = 1, gpus_per_bundle: float = 0, timeout_s: float = 60
) -> PlacementGroup:
    """`num_bundles` bundles of {CPU, GPU}, packed; a clear error at once when no node can hold one
    bundle, or when Ray cannot place them all in time."""
    bundle = {"CPU": cpus_per_bundle, **({"GPU": gpus_per_bundle} if gpus_per_bundle else {})}
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    if not any(all(node.get(k, 0) >= v for k, v in bundle.items()) for node in nodes):
        largest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)))
        raise RuntimeError(
            f"no node of the Ray cluster can hold one bundle of {bundle}: a bundle must fit on one node, and the "
            f"largest has {{'CPU': {largest.get('CPU', 0)}, 'GPU': {largest.get('GPU', 0)}}} ({len(nodes)} nodes). "
            "Lower trainer.placement.cpus_per_worker (the CPUs of each bundle), or add bigger nodes."
        )
    pg = placement_group([dict(bundle) for _ in range(num_bundles)], strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except GetTimeoutError as e:
        remove_placement_group(pg)
        raise RuntimeError(
            f"Ray could not place {num_bundles} bundles of {bundle} within {timeout_s:.0f} s: the cluster has "
            f"{ray.cluster_resources()} in total and {ray.available_resources()} free. Use fewer workers, "
            "smaller bundles, or add nodes (ray start --address=...)."
        ) from e
    return pg


def _done_and(worker: Any, method: str, *args: Any) -> tuple[None, Any]:
    return None, getattr(worker, method)(*args)


def _register_serializer(_: Any) -> None:
    register_tensor_serializer()  # in a rank's process: its outputs and weights


def pin_to_cores(actors: Sequence[tuple[Any, int]], cores: list[int] | None = None) -> list[int] | None:
    """Give each `(actor, n)` `n` cores of its own (every thread of its process), in order from the
    first of `cores` (default: the cores this process may use), and move this process and its other
    descendants (a local cluster's Ray daemons) onto the first actor's cores; only on a one-node
    cluster with enough cores for the actors. Returns the cores it shared out (for `unpin_driver`, or
    to pin again after an actor was replaced), or None when it did not pin.
    Ray's CPUs are logical: without pinning the OS moves every process over every core."""
    cores = cores or sorted(os.sched_getaffinity(0))
    wanted = [max(1, n) for _, n in actors]
    if len([n for n in ray.nodes() if n["Alive"]]) != 1 or sum(wanted) > len(cores):
        return None
    starts = [sum(wanted[:i]) for i in range(len(wanted))]
    refs = [
        actor.__ray_call__.remote(_pin_threads, cores[start : start + n])
        for (actor, _), start, n in zip(actors, starts, wanted, strict=True)
    ]
    try:
        pinned = ray.get(refs, timeout=PIN_TIMEOUT_S)
    except GetTimeoutError as e:
        late = [i for i, ref in enumerate(refs) if ref in ray.wait(refs, num_returns=len(refs), timeout=0)[1]]
        raise RuntimeError(
            f"actors {[actors[i][0] for i in late]} did not answer the call that pins them to cores within "
            f"{PIN_TIMEOUT_S:g} s; an actor may be stuck in a call of its own"
        ) from e
    _pin_driver(cores[: wanted[0]], skip={pid for pids in pinned for pid in pids})
    return cores


def unpin_driver(cores: list[int]) -> None:
    """Give this process and its descendants `cores` again (what `pin_to_cores` returned)."""
    _pin_driver(cores, skip=set())


def _pin_driver(cores: list[int], skip: set[int]) -> list[int]:
    """Bind every thread of this process and of its descendants not in `skip` to `cores` (threads
    started later inherit it); returns the processes' ids."""
    driver = psutil.Process()
    processes = [p for p in [driver, *driver.children(recursive=True)] if p.pid not in skip]
    for process in processes:
        with contextlib.suppress(psutil.Error, OSError):  # e.g. a process that just exited
            for thread in process.threads():
                os.sched_setaffinity(thread.id, cores)
    return [p.pid for p in processes]


def _pin_threads(_actor: Any, cores: list[int]) -> list[int]:
    """`_pin_driver` inside an actor (`__ray_call__`): the actor's process and its children."""
    return _pin_driver(cores, skip=set())


def node_free_port() -> tuple[str, int]:
    """This node's IP address and a port that is free on it now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


class ActorGroup:
    """`num_workers` actors of one FSDP worker class, rank i on bundle `bundle_offset + i`.

    Each is `worker_cls(cfg, rank, num_workers, model_path, **worker_kwargs)` (`cfg` the
    `trainer` section). `resource_fraction` of each bundle's CPU/GPU goes to each actor
    (1.0: the bundle is theirs; 0.5: another group can be colocated on the same bundles).
    Every blocking call waits at most `cfg.rpc_timeout_s`; past it the error names the role, the
    method and the ranks that did not answer. With `wait=False` the actors start (process group,
    model) while the caller goes on, and `wait_until_ready` waits for them: several groups start at
    once.
    """

    def __init__(
        self,
        worker_cls: type[FSDPWorker],
        cfg: TrainerConfig,
        model_path: str,
        num_workers: int,
        pg: PlacementGroup,
        bundle_offset: int = 0,
        resource_fraction: float = 1.0,
        wait: bool = True,
        **worker_kwargs: Any,
    ):
        self.num_workers, self.timeout_s, self.role = num_workers, cfg.rpc_timeout_s, worker_cls.role
        section = worker_kwargs.get("section") or getattr(cfg, worker_cls.role)
        self.sp_size = section.sequence_parallel_size  # ranks per sequence-parallel group
        bundle = pg.bundle_specs[bundle_offset]
        remote_cls = ray.remote(worker_cls)
        self.actors = [
            remote_cls.options(
                num_cpus=bundle.get("CPU", 0) * resource_fraction,
                num_gpus=bundle.get("GPU", 0) * resource_fraction,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle_offset + rank
                ),
            ).remote(cfg, rank, num_workers, model_path, **worker_kwargs)
            for rank in range(num_workers)
        ]
        # rank 0's address reaches every rank's init_process_group as object refs: nothing blocks here
        address = self.actors[0].__ray_call__.options(num_returns=2).remote(lambda _: node_free_port())
        self._starting = [
            ("init_process_group", [actor.init_process_group.remote(*address) for actor in self.actors]),
            ("init_model", [actor.init_model.remote() for actor in self.actors]),
            # after them (a failed start is reported by its own call), before anything a rank sends
            (
                "register_tensor_serializer",
                [a.__ray_call__.remote(_register_serializer) for a in self.actors],
            ),
        ]
        register_tensor_serializer()  # batches go out of this process
        if wait:
            self.wait_until_ready()

    def wait_until_ready(self) -> None:
        """Wait until every rank has joined the process group and loaded its model; a group that failed
        to start is killed (it must not hold its bundles) and the error raised."""
        try:
            for method, refs in self._starting:
                self._get(refs, method)
        except BaseException:
            self.kill()
            raise

    def rank0_free_port(self) -> tuple[str, int]:
        """An address and a free port on rank 0's node, for a rendezvous hosted by rank 0."""
        return self._get([self.actors[0].__ray_call__.remote(lambda _: node_free_port())], "rendezvous")[0]

    def _wait(self, refs: list[ray.ObjectRef], method: str) -> None:
        """Wait for `refs` (ref i from rank i) without fetching them. `WorkerDiedError` as soon as a
        rank that finished is found dead (the others may be waiting for it in a collective);
        `RuntimeError` naming the role, `method` and the ranks still running once `rpc_timeout_s` passed."""
        deadline = time.monotonic() + self.timeout_s
        pending = refs
        while pending:
            timeout = min(DEATH_POLL_S, max(0.0, deadline - time.monotonic()))
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)
            if pending and len(pending) < len(refs):
                self._raise_if_dead([rank for rank, ref in enumerate(refs) if ref not in pending], method)
            if pending and time.monotonic() >= deadline:
                late = [rank for rank, ref in enumerate(refs) if ref in pending]
                raise RuntimeError(
                    f"{self.role} worker rank(s) {late} did not finish {method} within trainer.rpc_timeout_s="
                    f"{self.timeout_s:g} s (free resources: {ray.available_resources()}); an actor may be "
                    "waiting for resources or a collective hung"
                )

    def dead_ranks(self, ranks: Sequence[int] | None = None, timeout_s: float = 10.0) -> list[int]:
        """The ranks (of `ranks`, default all) whose actor is dead. A live rank busy with another call
        does not answer within `timeout_s` and counts as alive."""
        ranks = list(range(self.num_workers)) if ranks is None else list(ranks)
        pings = [self.actors[rank].__ray_call__.remote(lambda _: None) for rank in ranks]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
        dead = []
        for rank, ping in zip(ranks, pings, strict=True):
            if ping in ready:
                try:
                    ray.get(ping)
                except RayActorError:
                    dead.append(rank)
        return dead

    def _raise_if_dead(self, ranks: list[int], method: str, cause: str = "the actor process is gone") -> None:
        dead = self.dead_ranks(ranks)
        if dead:
            raise WorkerDiedError(self.role, dead, method, cause)

    def _get(self, refs: list[ray.ObjectRef], method: str) -> list[Any]:
        self._wait(refs, method)
        try:
            return ray.get(refs)
        except RayError as error:  # a peer of a dead rank may fail first (its collective lost the peer)
            self._raise_if_dead(list(range(len(refs))), method, str(error).splitlines()[0])
            raise

    def reconfigure(self, cfg: TrainerConfig, **worker_kwargs: Any) -> None:
        """Every rank starts over with `cfg` (and `worker_kwargs`, e.g. a reward model's `section`) as a new
        group's would: the model, optimizer and sequence-parallel groups made again in the same processes
        (~0.03 s for the tiny model, against ~5 s for new processes on 2 cores)."""
        section = worker_kwargs.get("section") or getattr(cfg, self.role)
        self.sp_size, self.timeout_s = section.sequence_parallel_size, cfg.rpc_timeout_s
        self.run("reconfigure", cfg, **worker_kwargs)

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method(*args, **kwargs)` on every rank and wait for all results."""
        return self._get([getattr(actor, method).remote(*args, **kwargs) for actor in self.actors], method)

    def run_async(self, method: str, *args: Any) -> Awaitable[list[Any]]:
        """Start `method(*args)` on every rank now; await the result for all ranks (no timeout: for
        collectives whose peers outside this group are awaited together with it). A dead rank raises
        `WorkerDiedError`."""
        refs = [getattr(actor, method).remote(*args) for actor in self.actors]

        async def results() -> list[Any]:
            try:
                return await asyncio.gather(*refs)
            except RayError as error:
                dead = await asyncio.to_thread(self.dead_ranks)
                if dead:
                    raise WorkerDiedError(self.role, dead, method, str(error).splitlines()[0]) from error
                raise

        return results()

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each sequence-parallel group of `sp_size` consecutive ranks is one."""
        return self.num_workers // self.sp_size

    def stage(
        self,
        data: TrainingInputBatch,
        mini_batch_boundaries: Sequence[tuple[int, int]],
        balance: bool = False,
        delay_split: bool = False,
        cost_weight: float | None = None,
    ) -> list[StagedMiniBatch]:
        """`data`'s mini-batches in the object store, split for this group's ranks (`MeshDispatch`)."""
        return MeshDispatch.stage_chunks(
            self.dp_size, data, mini_batch_boundaries, balance, delay_split, cost_weight
        )

    def _run_staged(self, method: str, staged: Sequence[StagedMiniBatch], **kwargs: Any) -> list[Any]:
        """`method` once on every rank over all of `staged`: each rank gets the staged lists that hold its
        parts (a sequence-parallel group's ranks: their data-parallel rank's) and `picks`, per mini-batch
        where in them its groups of fields are. One round trip per phase, not per mini-batch."""
        first = staged[0]
        extra = (
            {"dp_size": self.dp_size, "balance": first.balance, "cost_weight": first.cost_weight}
            if first.delayed
            else {}
        ) | kwargs
        calls = []
        for rank, actor in enumerate(self.actors):
            lists, picks = MeshDispatch.call_args(staged, rank // self.sp_size)
            calls.append(getattr(actor, method).remote(*lists, picks=picks, **extra))
        return self._get(calls, method)

    def forward(self, staged: Sequence[StagedMiniBatch], **kwargs: Any) -> TrainingInputBatch:
        """Per-row forward outputs (`logprobs` or `values`) of the staged rows, in order, pads removed;
        `kwargs` go to every rank's `forward` (e.g. `adapters=False`)."""
        outputs = self._run_staged("forward", staged, **kwargs)
        return MeshDispatch.gather(staged, outputs[:: self.sp_size])  # a sequence-parallel group's are equal

    def train(self, staged: Sequence[StagedMiniBatch], **kwargs: Any) -> list[dict[str, float]]:
        """One optimizer step per staged mini-batch (per epoch: `epochs=N`), in one call per rank; the metrics
        of each step (equal on every rank); `kwargs` go to every rank's `train_mini_batches` (e.g. `epochs`,
        `keep_gradients=True`)."""
        return self._run_staged("train_mini_batches", staged, **kwargs)[0]

    def save_checkpoint(self, path: str | Path) -> None:
        self.run("save_checkpoint", str(path))

    def load_checkpoint(self, path: str | Path) -> None:
        self.run("load_checkpoint", str(path))

    def full_state_dict(self) -> dict:
        return self.run("full_state_dict")[0]

    def rank0_ref(self, method: str, *args: Any) -> ray.ObjectRef:
        """Rank 0's result of the collective `method(*args)` (e.g. `full_state_dict`), left in the object
        store (engines fetch it without a driver copy)."""
        # each rank returns (None, result): fetching the Nones tells a failed or dead rank apart, not the results
        pairs = [
            actor.__ray_call__.options(num_returns=2).remote(_done_and, method, *args)
            for actor in self.actors
        ]
        self._get([done for done, _ in pairs], method)  # a collective: every rank must finish
        return pairs[0][1]

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
