"""The PPO/GRPO loop. `Trainer.train_step` is the table of contents of one step:

generate -> sequences and batch -> mini-batch boundaries -> old/ref logprobs and values
-> KL penalty in reward -> advantages -> train (per epoch, per mini-batch) -> weight sync
-> metrics; `fit` adds eval and checkpoints around it. With
`trainer.async_training.max_staleness` >= 1 "generate" takes episodes a `RolloutStream`
generated while the previous steps trained (`skyrl.train.generator.stream`).

Each job is a component of its own (the README's Development section has the map): `Cluster`
(placement, worker groups), `Engines` (client, endpoint), `WeightSync`, `Sampler`, `StepBatch`,
`PPOUpdate`, `Checkpoints` and `Recovery`. The trainer builds them in order and runs the loop.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from skyrl.train.checkpoints import Checkpoints
from skyrl.train.cluster import Cluster, Factories
from skyrl.train.config import preflight
from skyrl.train.dataset.prompt_dataset import PromptDataset, PromptLoader
from skyrl.train.engines import Engines
from skyrl.train.generator.base import build_generator
from skyrl.train.generator.rollout import allowed_token_ids
from skyrl.train.inference import InferenceEngineClient
from skyrl.train.inference.openai_server import OpenAIServer
from skyrl.train.ppo_update import PPOUpdate
from skyrl.train.recovery import Recovery
from skyrl.train.rewards import Rewards, source_configs
from skyrl.train.sampler import Sampler
from skyrl.train.schema import SkyRLConfig
from skyrl.train.step_batch import StepBatch
from skyrl.train.utils.preemption import Preemption
from skyrl.train.utils.seqlen_balancing import attention_cost_weight
from skyrl.train.utils.tracking import METRICS_FILE, step_line, timed
from skyrl.train.weight_sync import WeightSync
from skyrl.train.workers.actor_group import ActorGroup, WorkerDiedError

logger = logging.getLogger(__name__)


class Trainer:
    """Builds every component from a validated `SkyRLConfig` and runs the loop in `run_dir`; `factories`
    builds the processes, engines and tracker (tests pass recorders)."""

    def __init__(
        self,
        cfg: SkyRLConfig,
        run_dir: str | Path,
        model_path: str,
        datasets: tuple[PromptDataset, PromptDataset | None],
        factories: Factories | None = None,
    ):
        self.cfg, self.run_dir, self.model_path = cfg, Path(run_dir), model_path
        trainer, generator = cfg.trainer, cfg.generator
        self.checkpoints = Checkpoints(self.run_dir, trainer)
        self.checkpoints.check_fresh()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.step = 0
        self.preempted: int | None = None  # the signal that stopped `fit` early, with a checkpoint
        self._train_ended: float | None = None  # when the last step's training ended
        random.seed(trainer.seed)
        np.random.seed(trainer.seed)
        torch.manual_seed(trainer.seed)
        from transformers import AutoConfig, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # balance_dp balances by attention-aware workload, with the policy model's width
        model_config = AutoConfig.from_pretrained(model_path)
        self.cost_weight = attention_cost_weight(model_config.hidden_size)
        allowed = allowed_token_ids(self.tokenizer, cfg.environment)
        factories = factories or Factories()
        resources = factories.resources()
        preflight(cfg, resources, len(allowed), model_config)
        # logprobs of the distribution the engines sample from (greedy sampling: the plain softmax)
        sampled_from = {"temperature": generator.sampling.temperature or 1.0, "allowed_token_ids": allowed}
        reward_models = {name: s for name, s in source_configs(cfg.reward).items() if s.type == "model"}
        self.cluster = Cluster(cfg, model_path, resources, sampled_from, factories, reward_models)
        self.weight_sync = WeightSync.choose(cfg, self.cluster)
        self.engines = self._start_workers_and_engines(factories)
        self.cluster.pin_to_cores(self.client.engines)
        self.weight_sync.start(self.engines)
        if generator.http_endpoint.enabled or generator.agent:  # an agent talks to the endpoint
            self.engines.serve(generator.http_endpoint, model_path, self.run_dir)
        self.rollout = build_generator(self.client, self.tokenizer, generator, cfg.environment, self.server)
        train_set, eval_set = datasets
        loader = PromptLoader(
            train_set, trainer.train_batch_size, seed=trainer.seed, shuffle=cfg.data.shuffle
        )
        rewards = Rewards(cfg.reward, self.tokenizer, generator.env_failure, self.cluster.groups, trainer)
        self.sampler = Sampler(cfg, loader, eval_set, self.rollout, self.engines, rewards)
        self.update = PPOUpdate(cfg, self.cluster.groups)
        run_name = trainer.run_name or self.run_dir.name
        self.tracker = factories.tracker(
            trainer.logger, self.run_dir, trainer.project_name, run_name, asdict(cfg)
        )
        self.recovery = Recovery(
            trainer, self.cluster, self.engines, self.checkpoints, self.sampler, self.update, self.weight_sync
        )

    def _start_workers_and_engines(self, factories: Factories) -> Engines:
        """The worker groups and the engines, started at once where they can be (`Cluster.engines_first`);
        the engines serve when this returns."""

        def start_engines() -> Engines:
            return Engines.start(
                self.cfg,
                self.model_path,
                self.cluster.engine_placement(),
                factories.engine_client,
                restore_weights=self.weight_sync.restorer,
                on_restart=lambda client, _: self.cluster.repin(client.engines),
            )

        engines = start_engines() if self.cluster.engines_first else None
        try:
            self.cluster.start_workers()
        except BaseException:
            if engines is not None:
                engines.client.shutdown()
            raise
        engines = engines or start_engines()
        engines.wait_until_serving()
        return engines

    @property
    def client(self) -> InferenceEngineClient:
        return self.engines.client

    @property
    def server(self) -> OpenAIServer | None:
        """The HTTP endpoint over the engines, when one serves."""
        return self.engines.server

    @property
    def policy(self) -> ActorGroup:
        return self.cluster.groups.policy

    @property
    def weight_version(self) -> int:
        return self.weight_sync.version

    # ---- one step ----
    def train_step(self) -> dict[str, float]:
        timings: dict[str, float] = {}
        start = time.perf_counter()
        stream = self.sampler.stream
        engine_busy = stream.busy.seconds() if stream else 0.0
        with timed(timings, "generate"):
            episodes, excluded_uids, gen_metrics = self.sampler.generate(
                self.step, self.weight_version, self._train_ended
            )
        stream = self.sampler.stream  # started by the first step's generate
        if self.cluster.colocated:  # the engines hand the accelerator to the workers (a no-op on CPU)
            # the endpoint holds requests until the weight sync after training has woken the engines
            self.engines.run(self.engines.paused(self.client.sleep, resume=False))
        with timed(timings, "batch"):
            step = StepBatch.from_episodes(
                episodes, excluded_uids, self.cfg, self.tokenizer.pad_token_id, self.cost_weight
            )
        with timed(timings, "forward"):
            self.update.forward(step)
        with timed(timings, "advantages"):
            adv_metrics = self.update.compute_advantages(step.rows)
        with timed(timings, "train"):
            train_metrics = self.update.train(step)
        self._train_ended = time.perf_counter()
        step.release()
        with timed(timings, "sync"):
            if self.cluster.colocated:
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
            **step.metrics(self.policy.dp_size),
            "engine/restarts": float(self.client.restarts),
            "sync/bytes_per_engine": float(self.weight_sync.bytes_per_engine),
            "trainer/worker_restarts": float(self.recovery.restarts),
        }

    def sync_weights(self) -> None:
        """The policy's weights to every engine as the next version (`WeightSync.sync`)."""
        self.weight_sync.sync(self.engines, self.sampler.stream)

    # ---- checkpoints ----
    def save_checkpoint(self) -> Path:
        """This step's checkpoint of the trained workers and the driver."""
        return self.checkpoints.save(
            self.step, self.cluster.groups.trained(), self.recovery.driver_state(self.step)
        )

    def resume(self) -> Path | None:
        """Continue from the checkpoint `trainer.resume_mode` names (`latest`: the newest complete one in
        the run directory, if any); returns its path, or None when the run starts afresh."""
        path = self.checkpoints.to_resume()
        if path is not None:
            self.step = self.recovery.restore(path)
        return path

    # ---- the run ----
    def fit(self, stop_on_signals: bool = False) -> list[dict[str, float]]:
        """Train until `total_steps`; returns the per-step metrics of this process.

        With `stop_on_signals` (the CLI; main thread only) a SIGTERM or Ctrl-C during the training loop
        stops it after the step in progress, with a checkpoint, and `self.preempted` is the signal; a step
        that does not end within `trainer.preemption_grace_s` is abandoned (`Preempted` is raised).
        """
        trainer = self.cfg.trainer
        resumed = self.resume()
        if resumed:
            print(f"resumed from {resumed} at step {self.step}")
        dropped = self.tracker.rewind(self.step)
        if dropped:
            print(
                f"{METRICS_FILE}: dropped {dropped} records after step {self.step}, which this run logs again"
            )
        if trainer.eval_before_train and self.step == 0:
            evaluation = self.sampler.evaluate()
            self.tracker.log(evaluation, self.step)
            print("eval before training: " + ", ".join(f"{k} {v:.3f}" for k, v in evaluation.items()))
        history: list[dict[str, float]] = []
        first_step = self.step
        progress = tqdm(total=trainer.total_steps, initial=self.step, desc="training", unit="step")
        with (
            Preemption(trainer.preemption_grace_s)
            if stop_on_signals
            else contextlib.nullcontext() as preemption
        ):
            while self.step < trainer.total_steps:
                try:
                    metrics = self._step_with_extras(progress)
                except WorkerDiedError as error:
                    checkpoint, self.step = self.recovery.restart_workers(error)
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
        metrics = self.train_step()
        interval = self.cfg.trainer.eval_interval
        if interval and self.step % interval == 0:
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
        """Close the components in the reverse order of their construction."""
        self.sampler.stop_stream()
        self.engines.stop_serving()
        close = getattr(self.rollout, "close", None)  # agent sessions, env processes
        if close is not None:
            close()
        self.tracker.close()
        self.sampler.rewards.close()
        self.engines.close()
        self.cluster.close()
