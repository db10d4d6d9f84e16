"""One step's training rows and what was staged of them for the worker groups; made fresh each step.

The rows are `dataset.preprocess`'s step-wise sequences of the step's episodes. Mini-batch
boundaries are in prompt units (`compute_prompt_mini_batch_boundaries`), so the optimizer steps per
batch never depend on how many turns the episodes took. The forward fields are put in the object
store once per (DP size, boundaries): the policy, reference and critic forwards and every epoch
reuse them; the training fields are added to the same staged rows.
"""

from __future__ import annotations

import torch

from skyrl.train.dataset.preprocess import (
    collate_sequences,
    compute_prompt_mini_batch_boundaries,
    layout_metrics,
    mask_groups,
    prefix_groups,
    trajectories_to_sequences,
)
from skyrl.train.generator.rollout import Episode
from skyrl.train.schema import SkyRLConfig
from skyrl.train.training_batch import TrainingInputBatch
from skyrl.train.workers.actor_group import ActorGroup
from skyrl.train.workers.dispatch import MeshDispatch, StagedMiniBatch

# what every forward pass reads (prefix_group: which rows are computed as one sequence)
FORWARD_FIELDS = ["sequences", "attention_mask", "response_mask", "prefix_group"]


class StepBatch:
    """The step's rows (`rows`) and their staged mini-batches per worker group layout."""

    def __init__(self, rows: TrainingInputBatch, cfg: SkyRLConfig, cost_weight: float):
        self.rows, self.cfg, self.cost_weight = rows, cfg, cost_weight
        self._staged: dict[tuple, list[StagedMiniBatch]] = {}
        self.dispatch_bytes = 0  # what staging put in the object store

    @classmethod
    def from_episodes(
        cls,
        episodes: list[Episode],
        excluded_uids: set[str],
        cfg: SkyRLConfig,
        pad_token_id: int,
        cost_weight: float,
    ) -> StepBatch:
        """The step's training rows; rows of the `excluded_uids` groups get loss mask 0. With
        `stepwise_prefix_sharing` the steps of a trajectory that extend each other share a prefix group
        (computed as one sequence); otherwise every row is its own. `cost_weight`: the attention-aware
        workload's weight that `trainer.balance_dp` balances ranks by."""
        step_wise = cfg.generator.step_wise
        sequences = trajectories_to_sequences([e.trajectory for e in episodes], step_wise)
        rows = collate_sequences(sequences, pad_token_id)
        shared = step_wise and cfg.trainer.stepwise_prefix_sharing
        rows["prefix_group"] = torch.tensor(prefix_groups(sequences) if shared else range(len(sequences)))
        if excluded_uids:
            rows["loss_mask"] = mask_groups(rows["loss_mask"], rows.metadata["uids"], excluded_uids)
        return cls(rows, cfg, cost_weight)

    def bounds(self, mini_batch_size: int) -> list[tuple[int, int]]:
        """The rows' mini-batches of `mini_batch_size` prompts, as (start, end) row ranges."""
        return compute_prompt_mini_batch_boundaries(
            self.rows.metadata["uids"],
            mini_batch_size,
            self.cfg.trainer.train_batch_size,
            self.cfg.generator.step_wise,
            self.cfg.generator.n_samples_per_prompt,
        )

    def stage(self, group: ActorGroup, mini_batch_size: int) -> list[StagedMiniBatch]:
        """The forward fields staged for `group`, once per (DP size, boundaries)."""
        bounds = self.bounds(mini_batch_size)
        key = (group.dp_size, tuple(bounds))
        if key not in self._staged:
            trainer = self.cfg.trainer
            self._staged[key] = group.stage(
                self.rows.select(FORWARD_FIELDS),
                bounds,
                trainer.balance_dp,
                trainer.delay_split_by_dp,
                self.cost_weight,
            )
            self.dispatch_bytes += sum(mini.nbytes for mini in self._staged[key])
        return self._staged[key]

    def stage_fields(
        self, group: ActorGroup, mini_batch_size: int, fields: list[str]
    ) -> list[StagedMiniBatch]:
        """The staged forward fields plus `fields`, put once more with the same rows."""
        staged = self.stage(group, mini_batch_size)
        extended = MeshDispatch.add_fields(staged, self.rows.select(fields))
        self.dispatch_bytes += sum(b.nbytes - a.nbytes for a, b in zip(staged, extended, strict=True))
        return extended

    def release(self) -> None:
        """Drop the staged mini-batches: the object store frees them once no reference is left."""
        self._staged = {}

    def metrics(self, policy_dp_size: int) -> dict[str, float]:
        """The rows' layout: sequences, padding of the policy's mini-batches, object-store bytes, prefix sharing."""
        rows = self.rows
        bounds = self.bounds(self.cfg.trainer.policy_mini_batch_size)
        return {
            "batch/sequences": float(len(rows)),
            "batch/pad_fraction": pad_fraction(bounds, policy_dp_size),
            "dispatch/object_store_bytes": float(self.dispatch_bytes),
            **layout_metrics(rows["prefix_group"], rows["attention_mask"], rows.metadata["trajectory_ids"]),
        }


def pad_fraction(bounds: list[tuple[int, int]], dp_size: int) -> float:
    """Share of the rows sent to the DP ranks that are padding (each mini-batch padded to a multiple of dp_size)."""
    pads = sum((start - end) % dp_size for start, end in bounds)
    return pads / (bounds[-1][1] - bounds[0][0] + pads)
