"""How the policy's weights reach the engines: one class per path, chosen once from the config.

| path | what travels | a restarted engine gets the weights from |
|---|---|---|
| `object_store` | rank 0's full state dict, one object all engines read | the client's copy of the last update |
| `adapter` (LoRA, `lora_sync=adapter`) | rank 0's adapters (a few MB) | the client's copy |
| `broadcast` | one decoder layer at a time, policy rank 0 -> every engine rank over a collective group | the policy, in a new group (`restore`) |
| `ipc` | one layer at a time, policy rank i -> colocated engine i through shared memory | the policy (`restore`) |

Every path sends the engines' own dtype (fp32 master weights into bf16 engines would double the bytes).
A new path is a subclass with a `name` and `_update`, listed in `WEIGHT_SYNCS`.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, ClassVar

from skyrl.train.cluster import Cluster
from skyrl.train.engines import Engines
from skyrl.train.generator.stream import RolloutStream
from skyrl.train.inference import InferenceEngineClient
from skyrl.train.inference.weight_sync import WeightSyncGroup
from skyrl.train.schema import SkyRLConfig
from skyrl.train.workers.actor_group import ActorGroup

logger = logging.getLogger(__name__)


class WeightSync(abc.ABC):
    """Sends the policy's weights to the engines as a new version (`sync`); the version is its checkpointed
    state. `restorer` is the engine client's hook for a restarted engine on the paths whose client keeps
    no copy of the last update."""

    name: ClassVar[str]
    # the client re-sends its copy of the last update to a restarted engine
    keeps_copy: ClassVar[bool] = False
    adapters: ClassVar[bool] = False  # sends the LoRA adapters, not the (merged) weights

    def __init__(self, cfg: SkyRLConfig, cluster: Cluster):
        self.cfg, self.cluster = cfg, cluster
        self.version = 0
        self.dtype: str | None = None  # the engines' weight dtype (`start`)
        self.bytes_per_engine = 0.0  # what one sync sends each engine

    @staticmethod
    def choose(cfg: SkyRLConfig, cluster: Cluster) -> WeightSync:
        """The path for `generator.inference_engine.weight_sync` (`auto`: object store on CPU, shared memory
        for colocated GPU engines, broadcast for disaggregated ones; adapter sync for LoRA when set)."""
        engine = cfg.generator.inference_engine
        name = engine.weight_sync
        if name == "auto":
            name = ("ipc" if cluster.colocated else "broadcast") if cluster.on_gpu else "object_store"
        if cfg.trainer.policy.lora.rank and engine.lora_sync == "adapter":
            name = "adapter"  # a few MB, whatever the weights take
        logger.info("weight sync: %s", name)
        return WEIGHT_SYNCS[name](cfg, cluster)

    @property
    def policy(self) -> ActorGroup:
        assert self.cluster.groups is not None, "weight sync before the workers started"
        return self.cluster.groups.policy

    @property
    def restorer(self) -> Callable[[InferenceEngineClient], Awaitable[None]] | None:
        """The client's `restore_weights` hook: None where the client keeps a copy of the last update."""
        return None if self.keeps_copy else self.restore

    def start(self, engines: Engines) -> None:
        """Once the engines serve and the workers are ready: ask the engines' dtype and the bytes one sync
        sends, and set up what the path needs (broadcast: its group)."""
        self.dtype = engines.run(engines.client.health())[0].dtype
        self.bytes_per_engine = self.policy.run("sync_nbytes", self.adapters, self.dtype)[0]
        logger.info("weight sync: %.1f MB per engine (%s)", self.bytes_per_engine / 1e6, self.dtype)
        engines.run(self._join(engines.client))

    def rejoin(self, engines: Engines) -> None:
        """After the workers restarted: set up the path with the new policy ranks (broadcast: a new group)."""
        engines.run(self._join(engines.client))

    def sync(self, engines: Engines, stream: RolloutStream | None) -> None:
        """The policy's weights to every engine as the next version, with the endpoint paused; with a stream,
        on its loop, after the episodes in progress unless `generator.inflight_weight_updates`."""
        self.version += 1
        update = partial(engines.paused, self._update(engines.client, self.version))
        if stream is None:
            engines.run(update())
        else:
            stream.sync(update, self.version)

    async def restore(self, client: InferenceEngineClient) -> None:
        """The policy's weights to every engine again, at the engines' version (after an engine restart)."""
        await self._join(client)
        update = await asyncio.to_thread(self._update, client, client.weight_version, True)
        await update()

    async def _join(self, client: InferenceEngineClient) -> None:  # noqa: B027 (most paths need nothing)
        """What the path needs before a sync (a collective group); nothing by default."""

    @abc.abstractmethod
    def _update(
        self, client: InferenceEngineClient, version: int, resend: bool = False
    ) -> partial[Awaitable[None]]:
        """The client call that sends the policy's weights as `version` (`resend`: the engines' version again)."""

    def state_dict(self) -> dict[str, Any]:
        return {"weight_version": self.version}

    def load_state_dict(self, state: dict[str, Any], engines_version: int) -> None:
        # the engines accept only newer versions: after a worker restart theirs may be ahead
        self.version = max(state["weight_version"], engines_version)


class ObjectStoreSync(WeightSync):
    name = "object_store"
    keeps_copy = True

    def _update(
        self, client: InferenceEngineClient, version: int, resend: bool = False
    ) -> partial[Awaitable[None]]:
        return partial(client.update_weights, self.policy.rank0_ref("full_state_dict", self.dtype), version)


class AdapterSync(WeightSync):
    name = "adapter"
    keeps_copy = True
    adapters = True

    def _update(
        self, client: InferenceEngineClient, version: int, resend: bool = False
    ) -> partial[Awaitable[None]]:
        return partial(client.update_weights, self.policy.rank0_ref("adapter_state_dict"), version)


class BroadcastSync(WeightSync):
    name = "broadcast"

    async def _join(self, client: InferenceEngineClient) -> None:
        """Policy rank 0 (the sender) and every engine join a new group (a group has a fixed size: a
        restarted rank needs a new one)."""
        address = await asyncio.to_thread(self.policy.rank0_free_port)
        group = WeightSyncGroup(
            *address,
            world_size=client.weight_sync_world_size,
            backend="nccl" if self.cluster.on_gpu else "gloo",
            timeout_s=self.cfg.generator.inference_engine.weight_sync_timeout_s,
        )
        policy = self.policy
        await client.init_weight_sync(group, lambda: policy.run_async("init_weight_sync", group))

    def _update(
        self, client: InferenceEngineClient, version: int, resend: bool = False
    ) -> partial[Awaitable[None]]:
        spec = self.policy.run("weight_stream_spec", self.dtype)[0]
        send = partial(self.policy.run_async, "broadcast_weights", self.dtype)
        return partial(client.broadcast_weights, spec, version, send, resend=resend)


class IpcSync(WeightSync):
    name = "ipc"

    def _update(
        self, client: InferenceEngineClient, version: int, resend: bool = False
    ) -> partial[Awaitable[None]]:
        spec = self.policy.run("weight_stream_spec", self.dtype)[0]
        policy, dtype = self.policy, self.dtype
        return partial(
            client.share_weights,
            spec,
            version,
            lambda engines: policy.run_async("share_weights", engines, version, dtype),
            resend=resend,
        )


WEIGHT_SYNCS: dict[str, type[WeightSync]] = {
    cls.name: cls for cls in (ObjectStoreSync, AdapterSync, BroadcastSync, IpcSync)
}
