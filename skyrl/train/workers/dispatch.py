"""Mini-batch dispatch to data-parallel ranks, and the way back.

Per mini-batch: slice, pad to a multiple of the DP size with loss-masked rows,
assign rows to ranks (`split_train_data_by_dp`'s rule: strided, or sequence-length
balanced). Each rank's parts of every mini-batch go into the Ray object store
together, as one list (a `ray.put` costs ~1 ms whatever its size: one per rank,
not one per rank and mini-batch; the delayed split puts one list for every rank),
and a call hands each rank those lists and where its parts sit in them. A step stages the forward fields once per (DP
size, boundaries) and reuses them for every forward pass and epoch; fields known
later (advantages, old logprobs) are staged once more with the same rows and
travel as a separate part. Per-row outputs come back in the original row order
with every pad row removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import ray

from skyrl.train.training_batch import TrainingInputBatch, pad_training_input_batch, partition_rows

Slot = tuple[ray.ObjectRef, int]  # a staged list in the object store, and a position in it


@dataclass
class StagedMiniBatch:
    """One mini-batch in the object store and how to undo its split.

    `parts[k][dp_rank]` is the slot of rank `dp_rank`'s share of the k-th group of
    fields; with the delayed split `parts[k]` holds one slot (the whole padded
    mini-batch) and each rank takes its rows itself. `rows[dp_rank]` are the
    padded-mini-batch row indices that rank holds; rows at index >= `end - start`
    are padding. `nbytes` counts the tensor bytes put for this mini-batch.
    """

    start: int
    end: int
    rows: list[list[int]]
    parts: list[list[Slot]]
    delayed: bool
    balance: bool
    cost_weight: float | None
    nbytes: int

    def slots(self, dp_rank: int) -> list[Slot]:
        """Where rank `dp_rank`'s part of each group of fields is staged."""
        return [part[0 if self.delayed else dp_rank] for part in self.parts]

    def fetch(self, dp_rank: int, field_group: int = 0) -> TrainingInputBatch:
        """Rank `dp_rank`'s part of the `field_group`-th group of fields (with the delayed split: the whole
        padded mini-batch), fetched from the object store."""
        ref, position = self.slots(dp_rank)[field_group]
        return ray.get(ref)[position]

    def __len__(self) -> int:
        return len(self.rows)


def _put_parts(
    padded: Sequence[TrainingInputBatch], rows: Sequence[list[list[int]]], delayed: bool
) -> tuple[list[list[Slot]], list[int]]:
    """Every mini-batch of `padded` split by its `rows`, one put per rank (or whole, `delayed`: one put):
    per mini-batch its slots by rank, and the bytes put for it."""
    shares = [  # a view puts only its own elements (`register_tensor_serializer`, which actor groups call)
        [mini] if delayed else [mini.select_rows(r) for r in split]
        for mini, split in zip(padded, rows, strict=True)
    ]
    refs = [ray.put([ranks[rank] for ranks in shares]) for rank in range(len(shares[0]))] if shares else []
    slots = [[(ref, position) for ref in refs] for position in range(len(shares))]
    return slots, [sum(share.nbytes for share in ranks) for ranks in shares]


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
        """Per boundary: slice, pad to a multiple of `dp_size`, split; then one `ray.put` per rank of its
        rows of every mini-batch.

        `data` needs `sequences` and `attention_mask` (the balanced split counts
        tokens). With `delay_split` the whole padded mini-batches are put once and each
        rank takes its own part (`partition_rows` with the same `dp_size`, `balance` and
        `cost_weight`, the linear weight of the attention-aware cost balancing uses).
        """
        data = _fields_only(data)
        padded, rows = [], []
        for start, end in mini_batch_boundaries:
            mini = data.slice(start, end)
            padded.append(pad_training_input_batch(mini, (-len(mini)) % dp_size))
            rows.append(partition_rows(padded[-1], dp_size, balance, cost_weight))
        slots, nbytes = _put_parts(padded, rows, delay_split)
        return [
            StagedMiniBatch(start, end, split, [part], delay_split, balance, cost_weight, size)
            for (start, end), split, part, size in zip(
                mini_batch_boundaries, rows, slots, nbytes, strict=True
            )
        ]

    @staticmethod
    def add_fields(staged: Sequence[StagedMiniBatch], data: TrainingInputBatch) -> list[StagedMiniBatch]:
        """`staged` with the fields of `data` (same rows as when staged) put as one more part,
        padded and split exactly like the first; `staged` itself is unchanged."""
        layouts = {(mini.delayed, len(mini.rows)) for mini in staged}
        assert len(layouts) <= 1, f"add_fields to mini-batches staged for different layouts: {layouts}"
        data = _fields_only(data)
        padded = []
        for mini in staged:
            part = data.slice(mini.start, mini.end)
            padded.append(pad_training_input_batch(part, (-len(part)) % len(mini)))
        slots, nbytes = _put_parts(padded, [mini.rows for mini in staged], bool(staged) and staged[0].delayed)
        return [
            replace(mini, parts=[*mini.parts, part], nbytes=mini.nbytes + size)
            for mini, part, size in zip(staged, slots, nbytes, strict=True)
        ]

    @staticmethod
    def call_args(
        staged: Sequence[StagedMiniBatch], dp_rank: int
    ) -> tuple[list[ray.ObjectRef], list[list[tuple[int, int]]]]:
        """What rank `dp_rank`'s call over `staged` takes: the distinct staged lists that hold its parts,
        and per mini-batch the (list, position) of each group of fields (`FSDPWorker.rank_rows`'s picks)."""
        lists: dict[ray.ObjectRef, int] = {}
        picks = [
            [(lists.setdefault(ref, len(lists)), position) for ref, position in mini.slots(dp_rank)]
            for mini in staged
        ]
        return list(lists), picks

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
