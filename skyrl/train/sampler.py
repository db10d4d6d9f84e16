"""Episodes for each step and for evaluation.

`Sampler` draws the step's prompts from the loader (its position is the checkpointed state: the
prompts a step took, not those a stream drew ahead), runs them through the rollout manager, or
takes them from the `RolloutStream` that generates while the previous steps train
(`trainer.async_training.max_staleness` >= 1), applies dynamic sampling and the zero-variance
filter, and warns when rewards stop varying or environments fail.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from skyrl.train.dataset.prompt_dataset import PromptDataset, PromptLoader
from skyrl.train.engines import Engines
from skyrl.train.generator.base import generate_checked
from skyrl.train.generator.rollout import Episode, check_failures, rollout_metrics
from skyrl.train.generator.stream import RolloutStream, episode_staleness
from skyrl.train.rewards import Rewards, reward_metrics
from skyrl.train.schema import SkyRLConfig

logger = logging.getLogger(__name__)
TIED_STEPS_WARNING = 5  # warn after this many steps without a group that has reward variance


class Sampler:
    """The step's episodes (`generate`) and the held-out evaluation (`evaluate`) over `rollout`, a generator
    (`skyrl.train.generator.base`) whose engine calls run through `engines`."""

    def __init__(
        self,
        cfg: SkyRLConfig,
        loader: PromptLoader,
        eval_set: PromptDataset | None,
        rollout: Any,
        engines: Engines,
        rewards: Rewards,
    ):
        self.cfg, self.loader, self.eval_set, self.rollout, self.engines = (
            cfg,
            loader,
            eval_set,
            rollout,
            engines,
        )
        self.rewards = rewards
        self.stream: RolloutStream | None = None  # max_staleness >= 1: started by the first step
        self._loader_state = loader.state_dict()  # after the last batch of prompts a step took
        self._tied_steps = 0  # consecutive steps in which every group's rewards tied

    def state_dict(self) -> dict[str, Any]:
        # prompts the stream drew ahead are drawn again on resume
        return {"loader": self._loader_state, **self.rewards.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        self.rewards.load_state_dict(state)
        self._loader_state = self.loader.state_dict()
        self._tied_steps = 0

    def stop_stream(self) -> None:
        """Stop generating ahead: after a restore its draws were made for steps that now run again."""
        if self.stream is not None:
            self.stream.stop()
            self.stream = None

    def generate(
        self, step: int, weight_version: int, train_ended: float | None
    ) -> tuple[list[Episode], set[str], dict[str, float]]:
        """Episodes for one batch of prompts (step `step`, 0-based, trained at policy `weight_version`), the
        uids of the groups to leave out of the loss, and metrics.

        With dynamic sampling, groups whose episodes all scored the same are set aside and more prompts
        are drawn (at most `max_sample_batches` draws); if the batch is still short, set-aside groups
        fill it and are left out of the loss. `zero_variance_filter` leaves out every such group. Both
        decide per episode, on its total reward from the run's reward sources (before any KL penalty). `reward/*` and
        `episode/*` describe the trained batch; figures over every draw go under `dynamic_sampling/`.
        With a stream, `async/*` gives the trained episodes' staleness, the episodes dropped for
        exceeding it and how long before the previous step's training (ended at `train_ended`) their
        generation began.
        """
        algorithm, batch_size = self.cfg.trainer.algorithm, self.cfg.trainer.train_batch_size
        n = self.cfg.generator.n_samples_per_prompt
        filter_groups = algorithm.dynamic_sampling == "filter"
        kept: list[list[Episode]] = []
        set_aside: list[list[Episode]] = []
        drawn: list[Episode] = []
        seconds, dropped, started = 0.0, 0, []
        for draw in range(algorithm.max_sample_batches if filter_groups else 1):
            begin = time.perf_counter()
            out, dropped_now, started_at = self._draw(f"s{step}d{draw}", weight_version)
            dropped += dropped_now
            started += started_at
            seconds += time.perf_counter() - begin
            drawn += out
            for i in range(0, len(out), n):
                group = out[i : i + n]
                (set_aside if filter_groups and rewards_tie(group) else kept).append(group)
            if len(kept) >= batch_size:
                break
        groups = (kept + set_aside)[:batch_size]
        episodes = [e for g in groups for e in g]
        self._warn(step, groups, drawn)
        metrics = rollout_metrics(episodes, n, seconds) | reward_metrics(episodes)
        if started:
            ahead = train_ended - min(started) if train_ended else 0.0
            metrics |= async_metrics(episodes, weight_version, dropped, ahead)
        excluded: set[str] = set()
        if filter_groups:
            fillers = groups[len(kept) :]
            excluded = {g[0].trajectory.uid for g in fillers}
            metrics |= {
                "dynamic_sampling/draws": float(draw + 1),
                "dynamic_sampling/kept_groups": float(len(groups) - len(fillers)),
                "dynamic_sampling/filler_groups": float(len(fillers)),
                "dynamic_sampling/reward_mean": float(np.mean([e.reward for e in drawn])),
            }
        if algorithm.zero_variance_filter:
            tied = {g[0].trajectory.uid for g in groups if rewards_tie(g)}
            metrics["filter/zero_variance_groups"] = float(len(tied))
            excluded |= tied
        return episodes, excluded, metrics

    def _draw(self, prefix: str, weight_version: int) -> tuple[list[Episode], int, list[float]]:
        """One batch of prompts' episodes (uids `prefix` + `p<i>`), rewarded by the run's sources, the
        episodes a stream dropped as too stale, and when the stream began generating them (nothing without
        a stream)."""
        if self.cfg.trainer.async_training.max_staleness == 0:
            prompts = self.loader.next_batch()
            uids = [f"{prefix}p{i}" for i in range(len(prompts))]
            n = self.cfg.generator.n_samples_per_prompt
            out = self.engines.run(generate_checked(self.rollout, prompts, uids, n)).episodes
            self._loader_state = self.loader.state_dict()
            dropped, started = 0, []
        else:
            taken = self._stream().take(weight_version)
            self._loader_state = taken.loader_state
            out, dropped, started = taken.episodes, taken.dropped, [taken.started]
        self._reward(out, train=True)
        return out, dropped, started

    def _reward(self, episodes: list[Episode], train: bool) -> None:
        """The run's reward sources applied to `episodes`; `RuntimeError` when too many have failed."""
        if not self.rewards.env_only:
            self.engines.run(self.rewards.score(episodes, train))
            check_failures(episodes, self.cfg.generator.max_env_failure_fraction)

    def _warn(self, step: int, groups: list[list[Episode]], drawn: list[Episode]) -> None:
        self._tied_steps = self._tied_steps + 1 if all(rewards_tie(g) for g in groups) else 0
        for warning in (
            tied_rewards_warning(self._tied_steps),
            env_failure_warning(step + 1, drawn, self.cfg.generator.env_failure),
        ):
            if warning:
                logger.warning(warning)

    def _stream(self) -> RolloutStream:
        """The rollout stream, started at the first call (after a resume restored the loader)."""
        if self.stream is None:
            self.stream = RolloutStream(
                self.engines.loop(),
                self.rollout,
                self.loader,
                self.cfg.trainer.async_training.max_staleness,
                self.cfg.generator.inflight_weight_updates,
                self.engines.client.weight_version,
                self.cfg.generator.n_samples_per_prompt,
            )
        return self.stream

    def evaluate(self) -> dict[str, float]:
        """Greedy pass@1 and sampled pass@k on the held-out prompts."""
        if self.eval_set is None:
            return {}
        prompts = list(self.eval_set.rows)
        metrics = {}
        for name, sampling, n in (
            ("greedy", self.cfg.generator.eval_sampling, 1),
            ("sampled", self.cfg.generator.sampling, self.cfg.trainer.eval_n_samples),
        ):
            uids = [f"eval{i}" for i in range(len(prompts))]
            out = self.engines.run(generate_checked(self.rollout, prompts, uids, n, sampling))
            self._reward(out.episodes, train=False)
            rollout = rollout_metrics(out.episodes, n, 0.0)  # the episodes', whatever the generator reports
            metrics[f"eval/{name}/reward_mean"] = rollout["reward/mean"]
            metrics[f"eval/{name}/pass@{n}"] = rollout[f"reward/pass@{n}"]
        return metrics


def tied_rewards_warning(tied_steps: int) -> str | None:
    """The console warning once every group's rewards tied for `TIED_STEPS_WARNING` steps in a row."""
    if tied_steps != TIED_STEPS_WARNING:
        return None
    return (
        f"for {tied_steps} steps every prompt group's samples all got the same reward, so group-relative "
        "advantages are 0 and the policy does not learn (grad_norm 0). Check the environment's rewards and "
        "its action space (environment.config.<env>.allowed_tokens); more samples per prompt or a higher "
        "temperature also help."
    )


def env_failure_warning(step: int, episodes: list[Episode], env_failure: str) -> str | None:
    """The console warning of a step whose environments raised: how many episodes, what their turns
    train on (`generator.env_failure`) and the first error; None when none raised."""
    failed = [e for e in episodes if e.stop_reason == "error"]
    if not failed:
        return None
    trained = "masked out of the loss" if env_failure == "mask" else "trained with reward 0"
    first = failed[0]
    return (
        f"step {step}: {len(failed)} of {len(episodes)} episodes failed in their environment, agent or a reward source (their turns are "
        f"{trained}); first: {first.trajectory.trajectory_id}: {first.error}"
    )


def async_metrics(
    episodes: list[Episode], weight_version: int, dropped: int, ahead_s: float
) -> dict[str, float]:
    """`async/*` of a step trained at `weight_version` on a stream's `episodes`: their staleness, the episodes
    dropped for exceeding it, how long before the previous step's training ended they began."""
    staleness = [episode_staleness(e, weight_version) for e in episodes]
    return {
        "async/staleness_mean": float(np.mean(staleness)),
        "async/staleness_max": float(max(staleness)),
        "async/dropped_episodes": float(dropped),
        "async/started_ahead_s": ahead_s,
    }


def rewards_tie(group: list[Episode]) -> bool:
    """True when every episode of a prompt group has the same total reward (no learning signal)."""
    return len({round(e.reward, 6) for e in group}) == 1


def load_datasets(cfg: SkyRLConfig, tokenizer: Any) -> tuple[PromptDataset, PromptDataset | None]:
    """Train and eval prompts from files, or generated for the environment when no file is given."""
    from skyrl.envs import calculator, guess_number

    data, env = cfg.data, cfg.environment

    def generated(num: int, seed: int, source: str) -> PromptDataset:
        if env.env_class == "guess_number":
            game = env.config.get("guess_number", {})
            records = guess_number.make_dataset(num, seed, game.get("min_value", 1), game.get("max_value", 8))
        elif env.env_class == "calculator":
            calls = env.config.get("calculator", {}).get("function_calling", False)
            records = calculator.make_dataset(num, seed, function_calling=calls)
        else:
            raise ValueError(
                f"data.train_path is null but environment.env_class={env.env_class!r} has no prompt generator; "
                "set data.train_path to a parquet/jsonl file (generators exist for guess_number and calculator)"
            )
        return PromptDataset.from_records(records, tokenizer, data.max_prompt_length, source)

    seed = cfg.trainer.seed
    if data.train_path:
        train = PromptDataset.from_path(data.train_path, tokenizer, data.max_prompt_length)
    else:
        train = generated(data.num_generated_train_prompts, seed, f"generated {env.env_class} train prompts")
    if data.eval_path:
        evals = PromptDataset.from_path(data.eval_path, tokenizer, data.max_prompt_length)
    elif data.train_path is None and (cfg.trainer.eval_interval or cfg.trainer.eval_before_train):
        evals = generated(
            data.num_generated_eval_prompts, seed + 1, f"generated {env.env_class} eval prompts"
        )
    else:
        evals = None
    return train, evals
