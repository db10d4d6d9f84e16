"""Where the run's processes live: placement groups, the policy / reference / critic worker groups on
them, the colocated engines' share of a bundle, and (disaggregated on CPU) cores of their own.

`Cluster` takes the cluster's resources as Ray reported them once (`Factories.resources`); the trainer checks
them against the config (`config.preflight`) before the cluster reserves anything. Colocated, one
placement group holds every worker group and the engines, each taking a fraction of a bundle;
disaggregated, each role has its own. `Factories` holds the Ray-side constructors, so a test can
build a whole trainer over recorders.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from skyrl.train.inference import InferenceEngineClient
from skyrl.train.schema import ModelConfig, RefConfig, RewardSourceConfig, SkyRLConfig, TrainerConfig
from skyrl.train.utils.tracking import Tracker
from skyrl.train.workers.actor_group import ActorGroup, create_placement_group, pin_to_cores, unpin_driver
from skyrl.train.workers.fsdp_worker import (
    CriticWorker,
    FSDPWorker,
    PolicyWorker,
    RefWorker,
    RewardModelWorker,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Factories:
    """What the trainer's components build their processes and outputs with; tests pass recorders."""

    actor_group: Callable[..., ActorGroup] = ActorGroup
    placement_group: Callable[..., Any] = create_placement_group
    bundle_strategy: Callable[..., Any] = PlacementGroupSchedulingStrategy
    resources: Callable[[], Mapping[str, float]] = ray.cluster_resources
    pin_to_cores: Callable[..., list[int] | None] = pin_to_cores
    engine_client: Callable[..., InferenceEngineClient] = InferenceEngineClient.from_config
    tracker: Callable[..., Any] = Tracker


@dataclass(frozen=True)
class Roles:
    """The worker groups the algorithm needs besides the policy. `ref_from_policy`: the reference is the LoRA
    policy with its adapters disabled (no reference worker of its own)."""

    ref: bool
    critic: bool
    ref_from_policy: bool

    @classmethod
    def of(cls, trainer: TrainerConfig) -> Roles:
        algorithm = trainer.algorithm
        use_ref = algorithm.use_kl_loss or algorithm.use_kl_in_reward
        from_policy = (
            use_ref
            and bool(trainer.policy.lora.rank)
            and trainer.ref.model.path in (None, trainer.policy.model.path)
        )
        return cls(use_ref and not from_policy, algorithm.advantage_estimator == "gae", from_policy)


@dataclass
class WorkerGroups:
    """The running worker groups: the policy, the reference and critic when the algorithm needs them, and
    the reward models of `reward.sources` (by source name)."""

    policy: ActorGroup
    ref: ActorGroup | None
    critic: ActorGroup | None
    ref_from_policy: bool = False
    reward_models: dict[str, ActorGroup] = field(default_factory=dict)

    def all(self) -> list[ActorGroup]:
        return [g for g in (self.policy, self.ref, self.critic) if g is not None] + list(
            self.reward_models.values()
        )

    def trained(self) -> dict[str, ActorGroup]:
        """The groups whose weights train (what a checkpoint holds), by name."""
        return {"policy": self.policy} | ({"critic": self.critic} if self.critic is not None else {})

    def replace(self, fresh: WorkerGroups) -> None:
        """Take `fresh`'s groups (started after the old ones died): whoever holds this object uses them."""
        self.policy, self.ref, self.critic = fresh.policy, fresh.ref, fresh.critic
        self.reward_models = fresh.reward_models


class Cluster:
    """Placement groups and worker groups of a run (`start_workers`, `restart_workers`), the colocated
    engines' placement (`engine_placement`), core pinning and the release of it all (`close`).

    `sampled_from` goes to every worker: the engines' sampling temperature and allowed tokens, which the
    logprobs are of. `model_path` is the policy's resolved model (a null `trainer.<role>.model.path`).
    `reward_models` are the sources of type model (`reward.sources`), each a worker group of its own."""

    def __init__(
        self,
        cfg: SkyRLConfig,
        model_path: str,
        resources: Mapping[str, float],
        sampled_from: Mapping[str, Any],
        factories: Factories,
        reward_models: Mapping[str, RewardSourceConfig] | None = None,
    ):
        self.cfg, self.model_path, self.sampled_from = cfg, model_path, sampled_from
        self.factories = factories
        self.reward_models = dict(reward_models or {})
        self.on_gpu = resources.get("GPU", 0) > 0
        self.roles = Roles.of(cfg.trainer)
        self.colocated = cfg.trainer.placement.colocate_all
        self.groups: WorkerGroups | None = None
        self._driver_cores: list[int] | None = None
        self._placement_groups: list[Any] = []
        # policy, ref, critic, reward models, inference engines: colocated, each takes this fraction of every bundle
        shares = 1 + self.roles.ref + self.roles.critic + len(self.reward_models) + 1
        self.worker_fraction = 1.0 / shares if self.colocated else 1.0
        gpus = 1 if self.on_gpu else 0  # the driver may sit on a CPU node
        placement = cfg.trainer.placement
        self.engine_resources = {
            "num_cpus": placement.cpus_per_worker * self.worker_fraction,
            "num_gpus": gpus * self.worker_fraction,
        }

        def bundles(size: int) -> Any:
            pg = factories.placement_group(
                size, cpus_per_bundle=placement.cpus_per_worker, gpus_per_bundle=gpus
            )
            self._placement_groups.append(pg)
            return pg

        self._shared_pg = bundles(placement.ranks("policy")) if self.colocated else None
        roles = ["policy"] + ["ref"] * self.roles.ref + ["critic"] * self.roles.critic
        # worker group -> (its ranks, their placement group); colocated, every group has the policy's ranks
        sizes = {role: placement.ranks(role) for role in roles} | {
            f"reward:{name}": source.num_nodes * source.num_gpus_per_node
            for name, source in self.reward_models.items()
        }
        self._worker_pgs = {
            key: (placement.ranks("policy"), self._shared_pg) if self.colocated else (size, bundles(size))
            for key, size in sizes.items()
        }

    @property
    def engines_first(self) -> bool:
        """Whether the engines start before the workers. On GPUs colocated engines size their memory by
        what the loaded workers left free: they start after them; otherwise both start (import, load)
        at the same time."""
        return not (self.colocated and self.on_gpu)

    def engine_placement(self) -> tuple[list[Any] | None, dict[str, float] | None]:
        """Colocated: engine i's scheduling strategy (bundle i of the shared group) and resources; else
        (None, None), the engines place themselves."""
        if not self.colocated:
            return None, None
        num_engines = self.cfg.generator.inference_engine.num_engines
        strategies = [
            self.factories.bundle_strategy(placement_group=self._shared_pg, placement_group_bundle_index=i)
            for i in range(num_engines)
        ]
        return strategies, self.engine_resources

    def start_workers(self) -> WorkerGroups:
        """The policy, ref and critic groups (`placement.ranks(role)` ranks each) and the reward models'
        groups, started at once; this call returns when all are ready (or kills them all and raises)."""
        trainer = self.cfg.trainer

        def group(
            worker_cls: type[FSDPWorker], model_path: str | None, key: str, **kwargs: Any
        ) -> ActorGroup:
            path = resolve_model_path(model_path) if model_path else self.model_path
            size, pg = self._worker_pgs[key]
            return self.factories.actor_group(
                worker_cls,
                trainer,
                path,
                size,
                pg,
                resource_fraction=self.worker_fraction,
                wait=False,
                **kwargs,
            )

        def role(worker_cls: type[FSDPWorker], model_path: str | None) -> ActorGroup:
            return group(worker_cls, model_path, worker_cls.role, **self.sampled_from)

        groups = WorkerGroups(
            role(PolicyWorker, None),
            role(RefWorker, trainer.ref.model.path) if self.roles.ref else None,
            role(CriticWorker, trainer.critic.model.path) if self.roles.critic else None,
            self.roles.ref_from_policy,
            {
                name: group(
                    RewardModelWorker,
                    s.model,
                    f"reward:{name}",
                    section=RefConfig(ModelConfig(s.model), sequence_parallel_size=s.sequence_parallel_size),
                )
                for name, s in self.reward_models.items()
            },
        )
        try:
            for g in groups.all():
                g.wait_until_ready()
        except BaseException:
            for g in groups.all():
                g.kill()
            raise
        if self.groups is None:
            self.groups = groups
        else:
            self.groups.replace(groups)
        return self.groups

    def restart_workers(self, engines: Sequence[Any]) -> None:
        """Kill every worker group (a dead rank breaks their collectives) and start them again on the same
        bundles and cores (`engines`: the engine actors, pinned with them)."""
        assert self.groups is not None, "restart_workers before start_workers"
        for group in self.groups.all():
            group.kill()
        self.start_workers()
        self.pin_to_cores(engines)

    def pin_to_cores(self, engines: Sequence[Any]) -> None:
        """Disaggregated on CPU: every engine and worker on cores of its own (`num_cpus_per_engine` x tensor
        parallel and `cpus_per_worker` each), when the node has enough (`pin_to_cores`); again after a
        restart, on the same cores."""
        if self.colocated or self.on_gpu:
            return
        engine_cfg, placement = self.cfg.generator.inference_engine, self.cfg.trainer.placement
        cores = int(engine_cfg.num_cpus_per_engine) * engine_cfg.tensor_parallel_size
        actors = [(engine, cores) for engine in engines]
        for group in self.groups.all() if self.groups else ():
            actors += [(worker, int(placement.cpus_per_worker)) for worker in group.actors]
        self._driver_cores = self.factories.pin_to_cores(actors, self._driver_cores)
        logger.info("engines and workers on cores of their own: %s", self.pinned_to_cores)

    def repin(self, engines: Sequence[Any]) -> None:
        """After an engine restart: the new engine takes the cores of the one it replaced (when pinned)."""
        if self.pinned_to_cores:
            self.pin_to_cores(engines)

    @property
    def pinned_to_cores(self) -> bool:
        """Whether the engines and workers run on cores of their own (`pin_to_cores`)."""
        return self._driver_cores is not None

    def close(self) -> None:
        """Kill the worker groups, release the placement groups and give the driver its cores back."""
        for group in self.groups.all() if self.groups else ():
            group.kill()
        for pg in self._placement_groups:
            remove_placement_group(pg)
        if self._driver_cores is not None:
            unpin_driver(self._driver_cores)


LOCAL_MODELS = ("tiny", "tiny-tools")  # the model paths `resolve_model_path` builds on this machine


def resolve_model_path(path: str) -> str:
    """`tiny` -> the default tiny model's cache directory, `tiny-tools` -> the tiny model that calls tools
    (`utils.tiny_tools_model`), each built on first use; anything else unchanged."""
    if path == "tiny":
        from skyrl.train.utils.tiny_model import default_tiny_model_path

        return str(default_tiny_model_path())
    if path == "tiny-tools":
        from skyrl.train.utils.tiny_tools_model import tiny_tools_model_path

        return str(tiny_tools_model_path())
    return path
