"""Splitting a rollout dict across data-parallel ranks."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from skyrl.train.utils.seqlen_balancing import get_seqlen_balanced_partitions

# One entry per sample; sliced by partition.
PER_SAMPLE_KEYS = (
    "tokens",
    "multimodal_train_inputs",
    "response_lengths",
    "rewards",
    "truncated",
    "loss_masks",
    "round_number",
    "sample_indices",
    "rollout_log_probs",
    "rollout_routed_experts",
    "prompt",
    "teacher_log_probs",
    "seq_witness_ids",
    "weight_versions",
)
# One entry per response token of the sample; length checked against the response length.
PER_TOKEN_KEYS = ("loss_masks", "rollout_log_probs", "teacher_log_probs")
# Shared by every rank; copied whole.
SHARED_KEYS = ("raw_reward", "dynamic_global_batch_size")


def _validate(data: dict[str, Any]) -> int:
    if "tokens" not in data:
        raise ValueError(f"rollout data has no 'tokens' key (keys: {sorted(data)})")
    unknown = sorted(set(data) - set(PER_SAMPLE_KEYS) - set(SHARED_KEYS))
    if unknown:
        raise ValueError(
            f"unknown rollout keys {unknown}; per-sample keys are {list(PER_SAMPLE_KEYS)}, "
            f"shared keys are {list(SHARED_KEYS)}"
        )
    n = len(data["tokens"])
    for key in PER_SAMPLE_KEYS:
        if key in data and len(data[key]) != n:
            raise ValueError(f"rollout key {key!r} has {len(data[key])} entries but 'tokens' has {n} samples")
    for i in range(n):
        if "response_lengths" in data:
            response_length = data["response_lengths"][i]
            if response_length > len(data["tokens"][i]):
                raise ValueError(
                    f"sample {i}: response_lengths[{i}]={response_length} exceeds its {len(data['tokens'][i])} tokens"
                )
            source = "response_lengths"
        elif "loss_masks" in data:
            response_length, source = len(data["loss_masks"][i]), "len(loss_masks)"
        else:
            continue
        for key in PER_TOKEN_KEYS:
            if key in data and len(data[key][i]) != response_length:
                raise ValueError(
                    f"sample {i}: {key}[{i}] has {len(data[key][i])} entries but its response length "
                    f"({source}) is {response_length}"
                )
    return n


def split_train_data_by_dp(
    data: dict[str, Any], dp_size: int, balance: bool = False, cost: Callable[[float], float] | None = None
) -> list[dict[str, Any]]:
    """Split a rollout dict into `dp_size` parts, one per data-parallel rank.

    Per-sample keys (`PER_SAMPLE_KEYS`) are sliced by each rank's partition,
    shared keys (`SHARED_KEYS`) are copied whole. Each part also gets
    `partition` (its sample indices) and `total_lengths` (token counts of ALL
    samples). `balance=True` assigns samples by token count with
    `get_seqlen_balanced_partitions(..., equal_size=True)` (workload `cost(length)` when given,
    e.g. `attention_aware_cost`); otherwise rank i
    takes `range(i, n, dp_size)`. Deterministic, so every rank computes the same
    split; the trainer's DP split (driver-side or delayed) uses these partitions
    too. Inputs are validated up front (`ValueError` naming key and index) and
    `data` is never mutated.
    """
    if dp_size <= 0:
        raise ValueError(f"dp_size must be positive, got {dp_size}")
    n = _validate(data)
    if n < dp_size:
        raise ValueError(
            f"cannot split {n} samples over dp_size={dp_size} ranks: every rank needs at least one sample"
        )
    total_lengths = [len(tokens) for tokens in data["tokens"]]
    if balance:
        partitions = get_seqlen_balanced_partitions(total_lengths, dp_size, equal_size=True, cost=cost)
    else:
        partitions = [list(range(i, n, dp_size)) for i in range(dp_size)]
    parts = []
    for partition in partitions:
        part: dict[str, Any] = {
            key: [data[key][i] for i in partition] for key in PER_SAMPLE_KEYS if key in data
        }
        part.update({key: copy.copy(data[key]) for key in SHARED_KEYS if key in data})
        part["partition"] = list(partition)
        part["total_lengths"] = list(total_lengths)
        parts.append(part)
    return parts
