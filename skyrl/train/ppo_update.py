"""The learning half of a step: old/reference logprobs and values, advantages, optimizer steps.

`PPOUpdate` runs on the worker groups of `WorkerGroups` (which a worker restart refills)
over a step's `StepBatch`: the forwards fill `old_logprobs`, `ref_logprobs` and
`old_values`; `compute_advantages` applies the KL penalty in the reward (the adaptive
controller's coefficient is its checkpointed state), the estimator and the off-policy
correction; `train` runs `update_epochs_per_batch` passes of one optimizer step per
mini-batch, critic first, and stops the run after too many non-finite steps in a row.

A step whose advantages do not read the old logprobs (no KL penalty in the reward, no off-policy
correction) runs no policy forward of its own: the policy worker computes them in the training call,
before its first optimizer step, as the forward would (a step of one optimizer step takes its training
forward's own; `PolicyWorker`), and reports the rollout logprob gap and the KL of the old logprobs
itself. Each worker group trains all epochs of a step in one call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from skyrl.train.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_to_rewards,
    compute_stepwise_advantages,
    get_advantage_estimator,
    kl_penalty,
    masked_mean,
    off_policy_correction,
    rollout_logprob_gap,
)
from skyrl.train.cluster import WorkerGroups
from skyrl.train.schema import SkyRLConfig
from skyrl.train.step_batch import StepBatch
from skyrl.train.training_batch import TrainingInputBatch


class PPOUpdate:
    """Forwards, advantages and optimizer steps of a step's batch; owns the KL controller and the counts of
    optimizer steps skipped in a row."""

    def __init__(self, cfg: SkyRLConfig, groups: WorkerGroups):
        self.cfg, self.groups = cfg, groups
        kl = cfg.trainer.algorithm.kl_ctrl
        self.kl_ctrl = (
            AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon)
            if kl.type == "adaptive"
            else FixedKLController(kl.kl_coef)
        )
        self._skipped_in_a_row = {"policy": 0, "critic": 0}  # optimizer steps skipped (non-finite), in a row

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.kl_ctrl.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The checkpointed KL coefficient; the skipped-step counts start over."""
        self.kl_ctrl.value = state["kl_coef"]
        self._skipped_in_a_row = {"policy": 0, "critic": 0}

    def old_logprobs_on_worker(self) -> bool:
        """Whether nothing before training reads the old logprobs: then the policy worker computes them
        in the training call (see the module docstring)."""
        algorithm = self.cfg.trainer.algorithm
        return not algorithm.use_kl_in_reward and algorithm.off_policy_correction == "none"

    def forward(self, step: StepBatch) -> None:
        """Old policy logprobs (unless `old_logprobs_on_worker`), reference logprobs and critic values of
        every row, into `step.rows`."""
        trainer, groups, rows = self.cfg.trainer, self.groups, step.rows
        policy_staged = step.stage(groups.policy, trainer.policy_mini_batch_size)
        if not self.old_logprobs_on_worker():
            rows["old_logprobs"] = groups.policy.forward(policy_staged)["logprobs"]
        if groups.ref is not None:
            staged = step.stage(groups.ref, trainer.policy_mini_batch_size)
            rows["ref_logprobs"] = groups.ref.forward(staged)["logprobs"]
        elif groups.ref_from_policy:
            rows["ref_logprobs"] = groups.policy.forward(policy_staged, adapters=False)["logprobs"]
        if groups.critic is not None:
            staged = step.stage(groups.critic, trainer.critic_mini_batch_size)
            rows["old_values"] = groups.critic.forward(staged)["values"]

    def compute_advantages(self, batch: TrainingInputBatch) -> dict[str, float]:
        """KL penalty in the reward (`use_kl_in_reward`), advantages and returns, off-policy correction."""
        algorithm = self.cfg.trainer.algorithm
        metrics: dict[str, float] = {}
        rewards = batch["rewards"]
        if "ref_logprobs" in batch and "old_logprobs" in batch:  # else the policy worker reports it
            kl = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], algorithm.kl_estimator)
            metrics["kl/mean"] = float(masked_mean(kl, batch["loss_mask"]))
            if algorithm.use_kl_in_reward:
                rewards = apply_kl_penalty_to_rewards(
                    rewards, kl * batch["loss_mask"], self.kl_ctrl.value, batch["response_mask"]
                )
                # trajectories, not rows: in step-wise mode rows depend on how many turns episodes took
                self.kl_ctrl.update(metrics["kl/mean"], len(set(batch.metadata["trajectory_ids"])))
                metrics["kl/coef"] = self.kl_ctrl.value
        options = {
            "gamma": algorithm.gamma,
            "lambd": algorithm.lambd,
            "norm_adv_by_std_in_grpo": algorithm.norm_adv_by_std_in_grpo,
            "group_baseline": algorithm.group_baseline,
        }
        values = batch["old_values"] if self.groups.critic is not None else None
        meta = batch.metadata
        if self.cfg.generator.step_wise:
            advantages, returns = compute_stepwise_advantages(
                algorithm.advantage_estimator,
                rewards,
                batch["response_mask"],
                meta["uids"],
                meta["trajectory_ids"],
                meta["is_last_step"],
                values,
                **options,
            )
        else:
            advantages, returns = get_advantage_estimator(algorithm.advantage_estimator)(
                rewards, batch["response_mask"], meta["uids"], values, **options
            )
        batch["advantages"], batch["returns"] = advantages, returns
        metrics["advantages/mean"] = float(masked_mean(advantages, batch["loss_mask"]))
        if "old_logprobs" in batch:  # else the policy worker reports it
            gap = rollout_logprob_gap(batch["rollout_logprobs"], batch["old_logprobs"], batch["loss_mask"])
            metrics["policy/rollout_logprob_gap"] = float(gap)
        if algorithm.off_policy_correction != "none":
            batch["is_weights"], batch["loss_mask"], is_metrics = off_policy_correction(
                batch["old_logprobs"],
                batch["rollout_logprobs"],
                batch["loss_mask"],
                algorithm.off_policy_correction,
                algorithm.tis_cap,
                algorithm.mis_low,
                algorithm.mis_high,
            )
            metrics |= {f"policy/{k}": float(v) for k, v in is_metrics.items()}
        metrics["batch/pad_free_tokens"] = float(batch["loss_mask"].sum())
        return metrics

    def train(self, step: StepBatch) -> dict[str, float]:
        """`update_epochs_per_batch` passes over the mini-batches, one optimizer step per mini-batch: the
        critic's, then the policy's (the two do not read each other), each group's in one call; metrics over
        all of them (`combine_optimizer_steps`)."""
        trainer, groups, rows = self.cfg.trainer, self.groups, step.rows
        # without old logprobs (`old_logprobs_on_worker`) the worker compares its own with the engine's
        old = "old_logprobs" if "old_logprobs" in rows else "rollout_logprobs"
        policy_fields = ["loss_mask", old, "advantages"]
        if trainer.algorithm.use_kl_loss:
            policy_fields.append("ref_logprobs")
        if "is_weights" in rows:
            policy_fields.append("is_weights")
        policy = step.stage_fields(groups.policy, trainer.policy_mini_batch_size, policy_fields)
        critic = None
        if groups.critic is not None:
            fields = ["loss_mask", "old_values", "returns"]
            critic = step.stage_fields(groups.critic, trainer.critic_mini_batch_size, fields)
        epochs = trainer.update_epochs_per_batch
        critic_history = groups.critic.train(critic, epochs=epochs) if critic is not None else []
        history = groups.policy.train(policy, epochs=epochs)
        for role, steps in (("policy", history), ("critic", critic_history)):
            self._skipped_in_a_row[role] = skipped_in_a_row(
                self._skipped_in_a_row[role], steps, role, trainer.max_consecutive_skipped_steps
            )
        metrics = {f"policy/{k}": v for k, v in combine_optimizer_steps(history).items()}
        if "policy/old_kl" in metrics:  # the worker's, from the old logprobs it computed
            metrics["kl/mean"] = metrics.pop("policy/old_kl")
        if critic_history:
            metrics |= {f"critic/{k}": v for k, v in combine_optimizer_steps(critic_history).items()}
        return metrics


def combine_optimizer_steps(history: list[dict[str, float]]) -> dict[str, float]:
    """A step's training metrics from those of its optimizer steps (each over its whole mini-batch):
    `loss`, `grad_norm` and `lr` averaged over the steps, `loss_tokens` and `skipped_steps` summed,
    `*_max` / `*_min` the
    extreme over the steps that had loss tokens, any other statistic weighted by each step's loss tokens
    (0 when no step had any), so neither a mini-batch without loss tokens nor the number of mini-batches
    changes them. Adds `optimizer_steps`."""
    tokens = [h["loss_tokens"] for h in history]
    total = sum(tokens)
    combined = {}
    for key in history[0]:
        values = [h[key] for h in history]
        if key in ("loss", "grad_norm", "lr"):
            combined[key] = float(np.mean(values))
        elif key in ("loss_tokens", "skipped_steps"):
            combined[key] = float(sum(values))
        elif key.endswith(("_max", "_min")):
            live = [v for v, n in zip(values, tokens, strict=True) if n > 0]
            combined[key] = float((max if key.endswith("_max") else min)(live)) if live else 0.0
        else:
            combined[key] = sum(v * n for v, n in zip(values, tokens, strict=True)) / total if total else 0.0
    combined["optimizer_steps"] = float(len(history))
    return combined


def skipped_in_a_row(before: int, steps: list[dict[str, float]], role: str, limit: int) -> int:
    """Optimizer steps of `role` skipped in a row (non-finite loss or gradient) after `steps`, counting on
    from `before`; `RuntimeError` once more than `limit` (`trainer.max_consecutive_skipped_steps`) were."""
    count = before
    for step in steps:
        count = count + 1 if step["skipped_steps"] else 0
        if count > limit:
            raise RuntimeError(
                f"{count} {role} optimizer steps in a row had a non-finite loss or gradient and were skipped "
                f"(more than trainer.max_consecutive_skipped_steps={limit}); the weights are those of the last "
                "finite step. Look for inf/NaN in rewards or advantages, or lower the learning rate."
            )
    return count
