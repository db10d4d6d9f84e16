"""Mini-batch dispatch to data-parallel ranks, and the way back.

Per mini-batch: slice, pad to a multiple of the DP size with loss-masked rows,
assign rows to ranks (`split_train_data_by_dp`'s rule: strided, or sequence-length
balanced), put each rank's part in the Ray object store. A step stages the
forward fields once per (DP size, boundaries) and reuses them for every forward
pass and epoch; fields known later (advantages, old logprobs) are staged once
more with the same rows and travel as a separate part. Per-row outputs come back
in the original row order with every pad row removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import ray

from skyrl.train.training_batch import TrainingInputBatch, pad_training_input_batch, partition_rows


@dataclass
class StagedMiniBatch:
    """One mini-batch in the object store and how to undo its split.

    `parts[k][dp_rank]` is rank `dp_rank`'s share of the k-th group of fields; with
    the delayed split `parts[k]` holds one ref (the whole padded mini-batch) and
    each rank takes its rows itself. `rows[dp_rank]` are the padded-mini-batch row
    indices that rank holds; rows at index >= `end - start` are padding. `nbytes`
    counts the tensor bytes put for this mini-batch.
    """

    start: int
    end: int
    rows: list[list[int]]
    parts: list[list[ray.ObjectRef]]
    delayed: bool
    balance: bool
    cost_weight: float | None
    nbytes: int

    def refs(self, dp_rank: int) -> list[ray.ObjectRef]:
        return [part[0 if self.delayed else dp_rank] for part in self.parts]

    def __len__(self) -> int:
        return len(self.rows)


def _put(batch: TrainingInputBatch) -> tuple[ray.ObjectRef, int]:
    own = batch.compact()  # a view would put the whole storage it views
    return ray.put(own), own.nbytes


def _put_part(
    padded: TrainingInputBatch, rows: list[list[int]], delayed: bool
) -> tuple[list[ray.ObjectRef], int]:
    puts = [_put(padded)] if delayed else [_put(padded.select_rows(r)) for r in rows]
    return [ref for ref, _ in puts], sum(n for _, n in puts)


def _fields_only(data: TrainingInputBatch) -> TrainingInputBatch:
    # workers read tensors only: metadata (uids, ids) stays on the driver
    return TrainingInputBatch(dict(data.items()))


class MeshDispatch:
    """Stage mini-batches for a DP mesh and gather per-row outputs back."""

    @staticmethod
    def stage_chunks(
        dp_size: int,
        data: TrainingInputBatch,
        mini_batch_boundaries: Sequence[tuple[int, int]],
        balance: bool = False,
        delay_split: bool = False,
        cost_weight: float | None = None,
    ) -> list[StagedMiniBatch]:
        """Per boundary: slice, pad to a multiple of `dp_size`, split, `ray.put` each rank's rows.

        `data` needs `sequences` and `attention_mask` (the balanced split counts
        tokens). With `delay_split` the whole padded mini-batch is put once and each
        rank takes its own part (`partition_rows` with the same `dp_size`, `balance` and
        `cost_weight`, the linear weight of the attention-aware cost balancing uses).
        """
        staged = []
        data = _fields_only(data)
        for start, end in mini_batch_boundaries:
            mini = data.slice(start, end)
            padded = pad_training_input_batch(mini, (-len(mini)) % dp_size)
            rows = partition_rows(padded, dp_size, balance, cost_weight)
            refs, nbytes = _put_part(padded, rows, delay_split)
            staged.append(
                StagedMiniBatch(start, end, rows, [refs], delay_split, balance, cost_weight, nbytes)
            )
        return staged

    @staticmethod
    def add_fields(staged: Sequence[StagedMiniBatch], data: TrainingInputBatch) -> list[StagedMiniBatch]:
        """`staged` with the fields of `data` (same rows as when staged) put as one more part,
        padded and split exactly like the first; `staged` itself is unchanged."""
        data = _fields_only(data)
        extended = []
        for mini in staged:
            part = data.slice(mini.start, mini.end)
            padded = pad_training_input_batch(part, (-len(part)) % len(mini))
            refs, nbytes = _put_part(padded, mini.rows, mini.delayed)
            extended.append(
                StagedMiniBatch(
                    mini.start,
                    mini.end,
                    mini.rows,
                    [*mini.parts, refs],
                    mini.delayed,
                    mini.balance,
                    mini.cost_weight,
                    mini.nbytes + nbytes,
                )
            )
        return extended

    @staticmethod
    def gather(
        staged: Sequence[StagedMiniBatch], outputs: Sequence[TrainingInputBatch]
    ) -> TrainingInputBatch:
        """Per-row outputs in the original row order, pad rows removed; `outputs[dp_rank]` holds that
        rank's rows of every mini-batch of `staged`, mini-batch after mini-batch."""
        offsets = [0] * len(outputs)
        parts = []
        for mini in staged:
            per_rank = []
            for rank, rows in enumerate(mini.rows):
                per_rank.append(outputs[rank].slice(offsets[rank], offsets[rank] + len(rows)))
                offsets[rank] += len(rows)
            joined = TrainingInputBatch.cat(per_rank)
            row_of = [row for rank_rows in mini.rows for row in rank_rows]
            position = {row: i for i, row in enumerate(row_of)}
            parts.append(joined.select_rows([position[row] for row in range(mini.end - mini.start)]))
        return TrainingInputBatch.cat(parts)
