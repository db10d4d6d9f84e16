"""The PPO/GRPO loop. `Trainer.train_step` is the table of contents of one step:

generate -> sequences and batch -> mini-batch boundaries -> old/ref logprobs and values
-> KL penalty in reward -> advantages -> train (per epoch, per mini-batch) -> weight sync
-> metrics; `fit` adds eval and checkpoints around it. With
`trainer.async_training.max_staleness` >= 1 "generate" takes episodes a `RolloutStream`
generated while the previous steps trained (`skyrl.train.generator.stream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Iterator
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tqdm import tqdm

from skyrl.train.checkpoints import Checkpoints
from skyrl.train.dataset.prompt_dataset import PromptDataset, PromptLoader
from skyrl.train.engines import Engines
from skyrl.train.generator.base import build_generator
from skyrl.train.generator.rollout import allowed_token_ids
from skyrl.train.inference import InferenceEngineClient, InferenceEngineConfig
from skyrl.train.inference.client import resolve_engine_config
from skyrl.train.inference.config import check_action_space
from skyrl.train.inference.openai_server import OpenAIServer
from skyrl.train.inference.weight_sync import WeightSyncGroup
from skyrl.train.ppo_update import PPOUpdate, WorkerGroups
from skyrl.train.sampler import Sampler
from skyrl.train.schema import SkyRLConfig
from skyrl.train.step_batch import StepBatch
from skyrl.train.utils.errors import ConfigError
from skyrl.train.utils.preemption import Preemption
from skyrl.train.utils.seqlen_balancing import attention_cost_weight
from skyrl.train.utils.tracking import METRICS_FILE, Tracker
from skyrl.train.workers.actor_group import (
    ActorGroup,
    WorkerDiedError,
    create_placement_group,
    pin_to_cores,
    unpin_driver,
)
from skyrl.train.workers.fsdp_worker import CriticWorker, FSDPWorker, PolicyWorker, RefWorker

logger = logging.getLogger(__name__)
# what every forward pass reads (prefix_group: which rows are computed as one sequence)
FORWARD_FIELDS = ["sequences", "attention_mask", "response_mask", "prefix_group"]


class Trainer:
    """Builds every component from a validated `SkyRLConfig` and runs the loop in `run_dir`."""

    def __init__(
        self,
        cfg: SkyRLConfig,
        run_dir: str | Path,
        model_path: str,
        datasets: tuple[PromptDataset, PromptDataset | None],
    ):
        self.cfg, self.run_dir, self.model_path = cfg, Path(run_dir), model_path
        t = cfg.trainer
        self.checkpoints = Checkpoints(self.run_dir, t)
        self.checkpoints.check_fresh()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.step = 0
        self.preempted: int | None = None  # the signal that stopped `fit` early, with a checkpoint
        self.weight_version = 0
        self._engine_dtype: str | None = None  # the engines' weight dtype, asked at the first sync
        self.sync_bytes = 0.0  # what one sync sends each engine (`_sync_dtype`)
        self._placement_groups: list[Any] = []
        random.seed(t.seed)
        np.random.seed(t.seed)
        torch.manual_seed(t.seed)
        from transformers import AutoConfig, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # balance_dp balances by attention-aware workload, with the policy model's width
        self.cost_weight = attention_cost_weight(AutoConfig.from_pretrained(model_path).hidden_size)
        self.allowed_token_ids = allowed_token_ids(self.tokenizer, cfg.environment)
        train_set, eval_set = datasets
        self.use_critic = t.algorithm.advantage_estimator == "gae"
        use_ref = t.algorithm.use_kl_loss or t.algorithm.use_kl_in_reward
        self.lora_sync = cfg.generator.inference_engine.lora_sync if t.policy.lora.rank else None
        # LoRA over the reference's own model: the policy with its adapters disabled is the reference
        self.ref_from_policy = (
            use_ref and bool(t.policy.lora.rank) and t.ref.model.path in (None, t.policy.model.path)
        )
        self.use_ref = use_ref and not self.ref_from_policy  # a reference worker of its own
        self.colocated = t.placement.colocate_all
        self._build_placement_groups()
        # on GPUs colocated engines size their memory by what the loaded workers left free: they start
        # after them; otherwise engines and workers start (import, load) at the same time
        engines_first = not (self.colocated and self._engine_resources["num_gpus"])
        if engines_first:
            client = self._start_engines()
        try:
            self.groups = self._start_workers()
        except BaseException:
            if engines_first:
                client.shutdown()
            raise
        self.update = PPOUpdate(cfg, self.groups)
        if not engines_first:
            client = self._start_engines()
        client.wait_until_serving()
        self.engines = Engines(client)
        self._driver_cores: list[int] | None = None
        self._pin_to_cores()
        self.weight_sync = self._init_weight_sync()
        if cfg.generator.http_endpoint.enabled or cfg.generator.agent:  # an agent talks to the endpoint
            self.engines.serve(cfg.generator.http_endpoint, self.model_path, self.run_dir)
        self.rollout = build_generator(
            self.client, self.tokenizer, cfg.generator, cfg.environment, self.server
        )
        loader = PromptLoader(train_set, t.train_batch_size, seed=t.seed, shuffle=cfg.data.shuffle)
        self.sampler = Sampler(cfg, loader, eval_set, self.rollout, self.engines)
        self._train_ended: float | None = None  # when the last step's training ended
        self.tracker = Tracker(
            t.logger, self.run_dir, t.project_name, t.run_name or self.run_dir.name, asdict(cfg)
        )
        self.worker_restarts = 0
        self._initial_state = self._driver_state()  # what a worker restart before any checkpoint returns to

    # ---- construction ----
    def _build_placement_groups(self) -> None:
        """Placement groups for the policy, and ref / critic when the algorithm needs them (one shared
        by all, engines included, when colocated); the worker groups go on them (`_start_workers`)."""
        p = self.cfg.trainer.placement
        cluster_gpus = ray.cluster_resources().get("GPU", 0)
        gpus = 1 if cluster_gpus > 0 else 0  # the driver may sit on a CPU node
        if cluster_gpus:  # a layout that cannot fit would wait for GPUs forever
            check_gpu_budget(self.cfg, self.use_ref, self.use_critic, int(cluster_gpus))
        groups = [True, self.use_ref, self.use_critic, True]  # policy, ref, critic, inference engines
        self._worker_fraction = 1.0 / sum(groups) if p.colocate_all else 1.0
        # what each colocated inference engine takes of its bundle
        self._engine_resources = {
            "num_cpus": p.cpus_per_worker * self._worker_fraction,
            "num_gpus": gpus * self._worker_fraction,
        }

        def bundles(role: str) -> Any:
            pg = create_placement_group(
                p.dp_size(role), cpus_per_bundle=p.cpus_per_worker, gpus_per_bundle=gpus
            )
            self._placement_groups.append(pg)
            return pg

        self._shared_pg = bundles("policy") if p.colocate_all else None
        roles = ["policy"] + ["ref"] * self.use_ref + ["critic"] * self.use_critic
        self._worker_pgs = {role: self._shared_pg or bundles(role) for role in roles}

    def _start_workers(self) -> WorkerGroups:
        """The policy, ref and critic `ActorGroup`s over the `trainer` section, `placement.dp_size(role)`
        ranks each, on the placement groups of `_build_placement_groups`; the groups start at once."""
        t = self.cfg.trainer
        # logprobs of the distribution the engines sample from (greedy sampling: the plain softmax)
        sampled_from = {
            "temperature": self.cfg.generator.sampling.temperature or 1.0,
            "allowed_token_ids": self.allowed_token_ids,
        }

        def group(worker_cls: type[FSDPWorker], model_path: str | None) -> ActorGroup:
            # null: the policy's model, self.model_path (resolved by the caller)
            path = resolve_model_path(model_path) if model_path else self.model_path
            role = worker_cls.role
            pg, size = self._worker_pgs[role], t.placement.dp_size(role)
            return ActorGroup(
                worker_cls,
                t,
                path,
                size,
                pg,
                resource_fraction=self._worker_fraction,
                wait=False,
                **sampled_from,
            )

        groups = WorkerGroups(
            group(PolicyWorker, None),
            group(RefWorker, t.ref.model.path) if self.use_ref else None,
            group(CriticWorker, t.critic.model.path) if self.use_critic else None,
            self.ref_from_policy,
        )
        try:
            for g in groups.all():
                g.wait_until_ready()
        except BaseException:
            for g in groups.all():
                g.kill()
            raise
        return groups

    @property
    def client(self) -> InferenceEngineClient:
        return self.engines.client

    @property
    def server(self) -> OpenAIServer | None:
        """The HTTP endpoint over the engines, when one serves."""
        return self.engines.server

    @property
    def policy(self) -> ActorGroup:
        return self.groups.policy

    @property
    def ref(self) -> ActorGroup | None:
        return self.groups.ref

    @property
    def critic(self) -> ActorGroup | None:
        return self.groups.critic

    def _start_engines(self) -> InferenceEngineClient:
        """The inference engines; colocated, engine i takes a fraction of the policy's bundle i and sleeps
        (freeing its GPU memory) while the workers train. A dead engine is restarted up to
        `generator.max_engine_restarts` times per run."""
        e = self._with_lora_rank(self.cfg.generator.inference_engine)
        restarts = self.cfg.generator.max_engine_restarts
        key = f"environment.config.{self.cfg.environment.env_class}.allowed_tokens"
        check_action_space(resolve_engine_config(e), len(self.allowed_token_ids), key)
        if not self.colocated:
            return InferenceEngineClient.from_config(e, self.model_path, max_restarts=restarts, wait=False)
        # engines and workers take turns on the bundle: each may use all of its CPUs (an hf engine's threads)
        e = replace(e, num_cpus_per_engine=self.cfg.trainer.placement.cpus_per_worker)
        strategies = [
            PlacementGroupSchedulingStrategy(placement_group=self._shared_pg, placement_group_bundle_index=i)
            for i in range(e.num_engines)
        ]
        if self._engine_resources["num_gpus"]:
            e = replace(e, enable_sleep_mode=True)
        return InferenceEngineClient.from_config(
            e, self.model_path, strategies, self._engine_resources, max_restarts=restarts, wait=False
        )

    def _with_lora_rank(self, e: InferenceEngineConfig) -> InferenceEngineConfig:
        """Adapter sync: engines that serve adapters of the policy's LoRA rank (unless set higher)."""
        if self.lora_sync != "adapter":
            return e
        return replace(e, max_lora_rank=e.max_lora_rank or self.cfg.trainer.policy.lora.rank)

    def _pin_to_cores(self) -> None:
        """Disaggregated on CPU: every engine and worker on cores of its own (`num_cpus_per_engine` x
        tensor parallel and `cpus_per_worker` each), when the node has enough (`pin_to_cores`)."""
        if self.colocated or ray.cluster_resources().get("GPU", 0) > 0:
            return
        e, p = self.cfg.generator.inference_engine, self.cfg.trainer.placement
        actors = [
            (engine, int(e.num_cpus_per_engine) * e.tensor_parallel_size) for engine in self.client.engines
        ]
        for group in (self.policy, self.ref, self.critic):
            actors += [(worker, int(p.cpus_per_worker)) for worker in group.actors] if group else []
        self._driver_cores = pin_to_cores(actors, self._driver_cores)  # again after a restart: same cores
        if self._driver_cores is not None:  # a restarted engine takes the cores of the one it replaces
            self.client.on_restart = lambda _: self._pin_to_cores()
        logger.info("engines and workers on cores of their own: %s", self.pinned_to_cores)

    @property
    def pinned_to_cores(self) -> bool:
        """Whether the engines and workers run on cores of their own (`_pin_to_cores`)."""
        return self._driver_cores is not None

    def _init_weight_sync(self) -> str:
        """Resolve `weight_sync` (`object_store`, `broadcast` or `ipc`); for `broadcast`, join policy rank 0
        and the engines in one group. For the paths that keep no copy of the weights (`broadcast`,
        `ipc`) a restarted engine gets them from the policy (`_resend_weights`)."""
        e = self.cfg.generator.inference_engine
        on_gpu = ray.cluster_resources().get("GPU", 0) > 0
        mode = e.weight_sync
        if mode == "auto":
            mode = ("ipc" if self.colocated else "broadcast") if on_gpu else "object_store"
        if mode == "broadcast" and on_gpu and self.colocated:
            raise ConfigError(
                "generator.inference_engine.weight_sync=broadcast needs engines on GPUs of their own (NCCL cannot "
                "join two ranks on one GPU), but trainer.placement.colocate_all=true; use weight_sync=ipc "
                "(or auto), or placement=disaggregated"
            )
        if self.lora_sync == "adapter":  # a few MB: the object store, whatever the weights would take
            mode = "object_store"
        logger.info("weight sync: %s%s", mode, f" (LoRA, {self.lora_sync})" if self.lora_sync else "")
        if mode != "object_store":
            self.client.weight_restorer = self._resend_weights
        if mode == "broadcast":
            self.engines.run(self._join_sync_group())
        return mode

    async def _join_sync_group(self) -> None:
        """Policy rank 0 (the sender) and every engine join a new broadcast group."""
        e = self.cfg.generator.inference_engine
        address = await asyncio.to_thread(self.policy.rank0_free_port)
        group = WeightSyncGroup(
            *address,
            world_size=self.client.weight_sync_world_size,
            backend="nccl" if ray.cluster_resources().get("GPU", 0) > 0 else "gloo",
            timeout_s=e.weight_sync_timeout_s,
        )
        await self.client.init_weight_sync(group, lambda: self.policy.run_async("init_weight_sync", group))

    async def _resend_weights(self) -> None:
        """The policy's weights to every engine again, at the engines' version: after an engine restart
        on a path that keeps no copy (broadcast: in a new group, since the old one has a dead rank)."""
        if self.weight_sync == "broadcast":
            await self._join_sync_group()
        update = await asyncio.to_thread(self._weight_update, self.client.weight_version, True)
        await update()

    # ---- one step ----
    def train_step(self) -> dict[str, float]:
        timings: dict[str, float] = {}
        start = time.perf_counter()
        stream = self.sampler.stream
        engine_busy = stream.busy.seconds() if stream else 0.0
        with _timer(timings, "generate"):
            episodes, excluded_uids, gen_metrics = self.sampler.generate(
                self.step, self.weight_version, self._train_ended
            )
        stream = self.sampler.stream  # started by the first step's generate
        if self.colocated:  # the engines hand the accelerator to the workers (a no-op on CPU)
            # the endpoint holds requests until the weight sync after training has woken the engines
            self.engines.run(self.engines.paused(self.client.sleep, resume=False))
        with _timer(timings, "batch"):
            step = StepBatch.from_episodes(
                episodes, excluded_uids, self.cfg, self.tokenizer.pad_token_id, self.cost_weight
            )
        with _timer(timings, "forward"):
            self.update.forward(step)
        with _timer(timings, "advantages"):
            adv_metrics = self.update.compute_advantages(step.rows)
        with _timer(timings, "train"):
            train_metrics = self.update.train(step)
        self._train_ended = time.perf_counter()
        step.release()
        with _timer(timings, "sync"):
            if self.colocated:
                self.engines.run(self.client.wake_up())
            self.sync_weights()
        self.step += 1
        window = time.perf_counter() - start
        # engines: generating; workers: computing logprobs or training (sync and the driver's work aside)
        engine_busy = stream.busy.seconds() - engine_busy if stream else timings["generate"]
        idle = {"engines": window - engine_busy, "workers": window - timings["forward"] - timings["train"]}
        return {
            **gen_metrics,
            **{f"idle/{k}_s": v for k, v in idle.items()},
            **{f"idle/{k}_fraction": v / window for k, v in idle.items()},
            **adv_metrics,
            **train_metrics,
            **{f"timing/{k}_s": v for k, v in timings.items()},
            "perf/tokens_per_s": float(step.rows["attention_mask"].sum()) / sum(timings.values()),
            **step.metrics(self.policy.num_workers),
            "engine/restarts": float(self.client.restarts),
            "sync/bytes_per_engine": float(self.sync_bytes),
            "trainer/worker_restarts": float(self.worker_restarts),
        }

    def sync_weights(self) -> None:
        """Policy weights to every engine (a full state dict through the object store, or group by group
        by broadcast or shared memory); bumps the weight version. With a stream the update runs on its
        loop, after the episodes in progress unless `generator.inflight_weight_updates`."""
        self.weight_version += 1
        version = self.weight_version
        update = partial(self.engines.paused, self._weight_update(version))
        if self.sampler.stream is None:
            self.engines.run(update())
        else:
            self.sampler.stream.sync(update, version)

    def _sync_dtype(self) -> str:
        """The engines' weight dtype, which every sync sends (fp32 master weights into bf16 engines would
        double the bytes); asked once, when the bytes per sync are logged too."""
        if self._engine_dtype is None:
            self._engine_dtype = self.engines.run(self.client.health())[0].dtype
            adapters = self.lora_sync == "adapter"
            self.sync_bytes = self.policy.run("sync_nbytes", adapters, self._engine_dtype)[0]
            logger.info("weight sync: %.1f MB per engine (%s)", self.sync_bytes / 1e6, self._engine_dtype)
        return self._engine_dtype

    def _weight_update(self, version: int, resend: bool = False) -> partial[Awaitable[None]]:
        """The engine-client call that sends the policy's weights as `version` by `weight_sync` (with
        `resend`, the engines' current version again)."""
        dtype = self._sync_dtype()
        if self.lora_sync == "adapter":
            return partial(self.client.update_weights, self.policy.rank0_ref("adapter_state_dict"), version)
        if self.weight_sync == "object_store":
            weights = self.policy.rank0_ref("full_state_dict", dtype)
            return partial(self.client.update_weights, weights, version)
        spec = self.policy.run("weight_stream_spec", dtype)[0]
        if self.weight_sync == "broadcast":
            send = partial(self.policy.run_async, "broadcast_weights", dtype)
            return partial(self.client.broadcast_weights, spec, version, send, resend=resend)
        hand = partial(self.policy.run_async, "share_weights")  # hand(engines, version, dtype)
        return partial(
            self.client.share_weights,
            spec,
            version,
            lambda engines: hand(engines, version, dtype),
            resend=resend,
        )

    # ---- checkpoints ----
    def _trained_groups(self) -> dict[str, ActorGroup]:
        """The worker groups a checkpoint holds, by name."""
        return {"policy": self.policy} | ({"critic": self.critic} if self.critic is not None else {})

    def save_checkpoint(self) -> Path:
        """This step's checkpoint of the trained workers and the driver."""
        return self.checkpoints.save(self.step, self._trained_groups(), self._driver_state())

    def _driver_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a checkpoint holds of the driver: the loop's state (JSON) and its random generators."""
        state = {
            "step": self.step,
            "weight_version": self.weight_version,
            **self.sampler.state_dict(),
            **self.update.state_dict(),
        }
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        return state, rng

    def resume(self) -> Path | None:
        """Continue from the checkpoint `trainer.resume_mode` names (`latest`: the newest complete one in
        the run directory, if any); returns its path, or None when the run starts afresh."""
        path = self.checkpoints.to_resume()
        if path is not None:
            self._restore(path)
        return path

    def _restore(self, path: Path | None) -> None:
        """Workers and driver from checkpoint `path`, or the state this run started in when None (the
        workers must be new then); then the engines get the restored policy's weights."""
        state, rng = (
            self._initial_state if path is None else self.checkpoints.load(path, self._trained_groups())
        )
        self.step = state["step"]
        # the engines accept only newer versions: after a worker restart theirs may be ahead
        self.weight_version = max(state["weight_version"], self.client.weight_version)
        self.sampler.load_state_dict(state)
        self.update.load_state_dict(state)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        self.sync_weights()

    def restart_workers(self, error: WorkerDiedError) -> Path | None:
        """After a worker died: kill every worker group (their collectives are broken), start them again
        on the same bundles and restore the last complete checkpoint (or the run's start), so the steps
        after it run again as after a resume; a worker that dies meanwhile costs another restart.
        Returns the checkpoint; `WorkerDiedError` naming `trainer.max_restarts` once the run has used
        its restarts."""
        limit = self.cfg.trainer.max_restarts
        while True:
            if self.worker_restarts >= limit:
                used = f"trainer.max_restarts={limit}" + (", all used" if limit else "")
                raise WorkerDiedError(
                    error.role, error.ranks, error.method, f"{error.cause} ({used})"
                ) from error
            self.worker_restarts += 1
            checkpoint = self.checkpoints.latest()
            logger.warning(
                "%s; restarting the workers from %s (restart %d of trainer.max_restarts=%d)",
                error,
                checkpoint.name if checkpoint else "the start of the run (no checkpoint yet)",
                self.worker_restarts,
                limit,
            )
            self.sampler.stop_stream()
            for group in self.groups.all():
                group.kill()
            try:
                self.groups.replace(self._start_workers())
                self._pin_to_cores()
                if self.weight_sync == "broadcast":  # the old group lost its sender: the engines join anew
                    self.weight_sync = self._init_weight_sync()
                if self.colocated:  # a worker may have died while the engines slept
                    self.engines.run(self.client.wake_up())
                self._restore(checkpoint)
            except WorkerDiedError as again:
                error = again
                continue
            return checkpoint

    # ---- the run ----
    def fit(self, stop_on_signals: bool = False) -> list[dict[str, float]]:
        """Train until `total_steps`; returns the per-step metrics of this process.

        With `stop_on_signals` (the CLI; main thread only) a SIGTERM or Ctrl-C during the training loop
        stops it after the step in progress, with a checkpoint, and `self.preempted` is the signal; a step
        that does not end within `trainer.preemption_grace_s` is abandoned (`Preempted` is raised).
        """
        t = self.cfg.trainer
        resumed = self.resume()
        if resumed:
            print(f"resumed from {resumed} at step {self.step}")
        dropped = self.tracker.rewind(self.step)
        if dropped:
            print(
                f"{METRICS_FILE}: dropped {dropped} records after step {self.step}, which this run logs again"
            )
        if t.eval_before_train and self.step == 0:
            evaluation = self.sampler.evaluate()
            self.tracker.log(evaluation, self.step)
            print("eval before training: " + ", ".join(f"{k} {v:.3f}" for k, v in evaluation.items()))
        history: list[dict[str, float]] = []
        first_step = self.step
        progress = tqdm(total=t.total_steps, initial=self.step, desc="training", unit="step")
        with Preemption(t.preemption_grace_s) if stop_on_signals else contextlib.nullcontext() as preemption:
            while self.step < t.total_steps:
                try:
                    metrics = self._step_with_extras(progress)
                except WorkerDiedError as error:
                    checkpoint = self.restart_workers(error)
                    del history[max(0, self.step - first_step) :]
                    self.tracker.rewind(self.step)
                    progress.n = self.step
                    progress.write(
                        f"a {error.role} worker died; workers restarted from "
                        f"{checkpoint.name if checkpoint else 'the start of the run'}, at step {self.step}"
                    )
                    continue
                self.tracker.log(metrics, self.step)
                history.append(metrics)
                progress.update(1)
                progress.write(step_line(self.step, metrics))
                if preemption is not None and preemption.at_boundary():
                    if not self.checkpoints.due(self.step):  # none saved at this step
                        progress.write(f"checkpoint: {self.save_checkpoint()}")
                    self.preempted = preemption.signum
                    break
        progress.close()
        return history

    def _step_with_extras(self, progress: tqdm) -> dict[str, float]:
        """One training step, then the eval, checkpoint and export due after it; the step's metrics."""
        t = self.cfg.trainer
        metrics = self.train_step()
        if t.eval_interval and self.step % t.eval_interval == 0:
            evaluation = self.sampler.evaluate()
            metrics |= evaluation
            progress.write(
                f"eval at step {self.step}: " + ", ".join(f"{k} {v:.3f}" for k, v in evaluation.items())
            )
        if self.checkpoints.due(self.step):
            progress.write(f"checkpoint: {self.save_checkpoint()}")
        if self.checkpoints.export_due(self.step):
            progress.write(self.checkpoints.export(self.step, self.policy))
        return metrics

    def shutdown(self) -> None:
        self.sampler.stop_stream()
        self.engines.stop_serving()
        close = getattr(self.rollout, "close", None)  # agent sessions, env processes
        if close is not None:
            close()
        self.tracker.close()
        self.engines.close()
        for group in self.groups.all():
            group.kill()
        for pg in self._placement_groups:
            remove_placement_group(pg)
        if self._driver_cores is not None:
            unpin_driver(self._driver_cores)


def step_line(step: int, m: dict[str, float]) -> str:
    timing = " ".join(
        f"{k[7:-2]} {v:.1f}s" for k, v in m.items() if k.startswith("timing/") and k != "timing/generate_s"
    )
    return (
        f"step {step}: reward {m['reward/mean']:.3f} turns {m['episode/turns']:.2f} "
        f"generate {m['timing/generate_s']:.1f}s {timing} grad_norm {m.get('policy/grad_norm', float('nan')):.3f}"
    )


@contextlib.contextmanager
def _timer(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start


def check_gpu_budget(cfg: SkyRLConfig, use_ref: bool, use_critic: bool, cluster_gpus: int) -> None:
    """`ConfigError` naming each model's GPUs when the layout needs more than the cluster's `cluster_gpus`:
    colocated, the policy's bundles hold everything; disaggregated, the policy, reference and critic
    ranks and `num_engines x tensor_parallel_size` engine GPUs each need GPUs of their own."""
    p, e = cfg.trainer.placement, cfg.generator.inference_engine
    roles = ["policy"] + (["ref"] * use_ref + ["critic"] * use_critic if not p.colocate_all else [])
    needs = {f"{role} ({role}_num_nodes x {role}_num_gpus_per_node)": p.dp_size(role) for role in roles}
    if not p.colocate_all:
        needs["engines (num_engines x tensor_parallel_size)"] = e.num_engines * e.tensor_parallel_size
    if sum(needs.values()) > cluster_gpus:
        parts = ", ".join(f"{name} {n}" for name, n in needs.items())
        raise ConfigError(
            f"this layout needs {sum(needs.values())} GPUs ({parts}), the Ray cluster has {cluster_gpus}; "
            "use fewer ranks or engines, trainer.placement.colocate_all=true (placement=colocated), or a "
            "bigger cluster."
        )


def resolve_model_path(path: str) -> str:
    """`tiny` -> the default tiny model's cache directory (built on first use); anything else unchanged."""
    if path == "tiny":
        from skyrl.train.utils.tiny_model import default_tiny_model_path

        return str(default_tiny_model_path())
    return path


def load_datasets(cfg: SkyRLConfig, tokenizer: Any) -> tuple[PromptDataset, PromptDataset | None]:
    """Train and eval prompts from files, or generated for the environment when no file is given."""
    from skyrl.envs import calculator, guess_number

    d, env = cfg.data, cfg.environment

    def generated(num: int, seed: int, source: str) -> PromptDataset:
        if env.env_class == "guess_number":
            g = env.config.get("guess_number", {})
            records = guess_number.make_dataset(num, seed, g.get("min_value", 1), g.get("max_value", 8))
        elif env.env_class == "calculator":
            records = calculator.make_dataset(num, seed)
        else:
            raise ValueError(
                f"data.train_path is null but environment.env_class={env.env_class!r} has no prompt generator; "
                "set data.train_path to a parquet/jsonl file (generators exist for guess_number and calculator)"
            )
        return PromptDataset.from_records(records, tokenizer, d.max_prompt_length, source)

    seed = cfg.trainer.seed
    if d.train_path:
        train = PromptDataset.from_path(d.train_path, tokenizer, d.max_prompt_length)
    else:
        train = generated(d.num_generated_train_prompts, seed, f"generated {env.env_class} train prompts")
    if d.eval_path:
        evals = PromptDataset.from_path(d.eval_path, tokenizer, d.max_prompt_length)
    elif d.train_path is None and (cfg.trainer.eval_interval or cfg.trainer.eval_before_train):
        evals = generated(d.num_generated_eval_prompts, seed + 1, f"generated {env.env_class} eval prompts")
    else:
        evals = None
    return train, evals
