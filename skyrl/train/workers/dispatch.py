"""Mini-batch dispatch to data-parallel ranks, and the way back.

Per mini-batch: slice, pad to a multiple of the DP size with loss-masked rows,
assign rows to ranks (`split_train_data_by_dp`'s rule: strided, or sequence-length
balanced), put each rank's part in the Ray object store. Per-row outputs come back
in the original row order with every pad row removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import ray

from skyrl.train.training_batch import TrainingInputBatch, pad_training_input_batch
from skyrl.train.utils.data import split_train_data_by_dp


def partition_rows(batch: TrainingInputBatch, dp_size: int, balance: bool) -> list[list[int]]:
    """Row indices of each DP rank, for a batch whose length is a multiple of `dp_size`.

    The `partition`s of `split_train_data_by_dp` over the rows' attended tokens.
    The driver-side split and the delayed split (each worker) both call this, and it
    is deterministic, so every rank gets the same rows either way.
    """
    n = len(batch)
    if n % dp_size != 0:
        raise ValueError(f"a batch of {n} rows cannot be split over {dp_size} ranks; pad it first")
    tokens = [seq[mask.bool()] for seq, mask in zip(batch["sequences"], batch["attention_mask"], strict=True)]
    return [part["partition"] for part in split_train_data_by_dp({"tokens": tokens}, dp_size, balance)]


@dataclass
class StagedMiniBatch:
    """One mini-batch in the object store: `refs[dp_rank]`, and how to undo the split.

    `rows[dp_rank]` are the padded-mini-batch row indices that rank holds; rows at
    index >= `num_rows` are padding. With the delayed split `refs` holds one ref
    (the whole padded mini-batch) that every rank reads.
    """

    refs: list[ray.ObjectRef]
    rows: list[list[int]]
    num_rows: int

    def __getitem__(self, dp_rank: int) -> ray.ObjectRef:
        return self.refs[dp_rank if len(self.refs) > 1 else 0]

    def __len__(self) -> int:
        return len(self.rows)


class MeshDispatch:
    """Stage mini-batches for a DP mesh and gather per-row outputs back."""

    @staticmethod
    def stage_chunks(
        dp_size: int,
        data: TrainingInputBatch,
        mini_batch_boundaries: Sequence[tuple[int, int]],
        balance: bool = False,
        delay_split: bool = False,
    ) -> list[StagedMiniBatch]:
        """Per boundary: slice, pad to a multiple of `dp_size`, split, `ray.put`.

        Returns `staged[mini_batch][dp_rank]` -> ObjectRef. With `delay_split` the
        whole padded mini-batch is put once and each rank takes its own part
        (`partition_rows` with the same `dp_size` and `balance`).
        """
        staged = []
        for start, end in mini_batch_boundaries:
            mini = data.slice(start, end)
            padded = pad_training_input_batch(mini, (-len(mini)) % dp_size)
            rows = partition_rows(padded, dp_size, balance)
            if delay_split:
                refs = [ray.put(padded)]
            else:
                refs = [ray.put(padded.select_rows(r)) for r in rows]
            staged.append(StagedMiniBatch(refs, rows, len(mini)))
        return staged

    @staticmethod
    def gather(
        staged: Sequence[StagedMiniBatch], outputs: Sequence[Sequence[TrainingInputBatch]]
    ) -> TrainingInputBatch:
        """Per-row outputs (`outputs[mini_batch][dp_rank]`) in the original row order, pad rows removed."""
        parts = []
        for mini, per_rank in zip(staged, outputs, strict=True):
            joined = TrainingInputBatch.cat(list(per_rank))
            row_of = [row for rank_rows in mini.rows for row in rank_rows]
            position = {row: i for i, row in enumerate(row_of)}
            parts.append(joined.select_rows([position[row] for row in range(mini.num_rows)]))
        return TrainingInputBatch.cat(parts)
