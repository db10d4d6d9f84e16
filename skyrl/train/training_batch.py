"""The batch that flows from the rollout manager to the training workers.

A `TrainingInputBatch` is a dict of per-row fields of equal length, plus a
`metadata` dict. Fields are tensors whose first dimension is the row, or a
`TensorList` when rows have different shapes. Metadata values that are lists
are per-row (one entry per row, e.g. `uids`, `is_last_step`) and follow every
slice, chunk, cat and pad; any other metadata value is shared by all rows and
is carried unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence

import torch

from skyrl.train.utils.data import split_train_data_by_dp
from skyrl.train.utils.seqlen_balancing import attention_aware_cost

PAD_UID_PREFIX = "__pad__"
# Row weights that must be zero on pad rows so they contribute nothing to any loss.
PAD_ZEROED_FIELDS = ("loss_mask", "response_mask", "advantages")


class TensorList:
    """A ragged column: one tensor per row, shapes may differ between rows."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = list(tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.tensors)

    def __getitem__(self, index: int | slice) -> torch.Tensor | TensorList:
        if isinstance(index, slice):
            return TensorList(self.tensors[index])
        return self.tensors[index]

    def __repr__(self) -> str:
        return f"TensorList(len={len(self)})"

    def index_select(self, indices: Sequence[int]) -> TensorList:
        return TensorList([self.tensors[i] for i in indices])

    def to(self, device: torch.device | str) -> TensorList:
        return TensorList([t.to(device) for t in self.tensors])

    @staticmethod
    def cat(lists: Sequence[TensorList]) -> TensorList:
        return TensorList([t for tl in lists for t in tl.tensors])


Field = torch.Tensor | TensorList


def _check_field(key: str, value: object) -> None:
    if not isinstance(value, (torch.Tensor, TensorList)):
        raise TypeError(f"field {key!r} must be a torch.Tensor or TensorList, got {type(value).__name__}")


def _num_rows(value: Field) -> int:
    return value.shape[0] if isinstance(value, torch.Tensor) else len(value)


def _select_field(value: Field, indices: Sequence[int]) -> Field:
    if isinstance(value, TensorList):
        return value.index_select(indices)
    return value[torch.as_tensor(list(indices), dtype=torch.long, device=value.device)]


def _cat_fields(values: Sequence[Field], key: str) -> Field:
    if all(isinstance(v, TensorList) for v in values):
        return TensorList.cat(values)
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.cat(values, dim=0)
    raise ValueError(
        f"cannot concatenate field {key!r}: it is a tensor in some batches and a TensorList in others"
    )


class TrainingInputBatch:
    """Equal-length per-row fields plus metadata; see the module docstring.

    `TrainingInputBatch({"sequences": t, "loss_mask": m})` builds one; rows of
    every field must agree, otherwise `ValueError` names the fields and counts.
    """

    def __init__(self, data: Mapping[str, Field], metadata: dict | None = None):
        self._data: dict[str, Field] = {}
        for key, value in data.items():
            _check_field(key, value)
            self._data[key] = value
        counts = {key: _num_rows(value) for key, value in self._data.items()}
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"{k}={n}" for k, n in counts.items())
            raise ValueError(f"TrainingInputBatch fields have different row counts: {listed}")
        self._batch_size = next(iter(counts.values()), 0)
        self.metadata: dict = metadata if metadata is not None else {}

    # dict-like access
    def __len__(self) -> int:
        return self._batch_size

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def __getitem__(self, key: str) -> Field:
        return self._data[key]

    def __setitem__(self, key: str, value: Field) -> None:
        _check_field(key, value)
        if _num_rows(value) != self._batch_size and self._data:
            raise ValueError(
                f"field {key!r} has {_num_rows(value)} rows but the batch has {self._batch_size}"
            )
        if not self._data:
            self._batch_size = _num_rows(value)
        self._data[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def get(self, key: str, default: Field | None = None) -> Field | None:
        return self._data.get(key, default)

    def keys(self):
        return self._data.keys()

    def items(self):
        return self._data.items()

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{k}: {tuple(v.shape) if isinstance(v, torch.Tensor) else repr(v)}"
            for k, v in self._data.items()
        )
        return f"TrainingInputBatch(rows={len(self)}, {fields}, metadata={sorted(self.metadata)})"

    # metadata helpers
    def _row_metadata_keys(self) -> list[str]:
        keys = []
        for key, value in self.metadata.items():
            if isinstance(value, list):
                if len(value) != self._batch_size:
                    raise ValueError(
                        f"metadata[{key!r}] is a list of {len(value)} entries but the batch has "
                        f"{self._batch_size} rows (list-valued metadata is per-row)"
                    )
                keys.append(key)
        return keys

    def _with_rows(self, data: dict[str, Field], row_meta: dict[str, list]) -> TrainingInputBatch:
        metadata = {k: copy.deepcopy(v) for k, v in self.metadata.items() if k not in row_meta}
        metadata.update(row_meta)
        return TrainingInputBatch(data, metadata)

    def _copy_metadata(self) -> dict:
        return {k: list(v) if isinstance(v, list) else copy.deepcopy(v) for k, v in self.metadata.items()}

    # row operations
    def slice(self, start: int, end: int) -> TrainingInputBatch:
        """Rows [start, end) as a new batch (tensor fields are views)."""
        row_keys = self._row_metadata_keys()
        return self._with_rows(
            {k: v[start:end] for k, v in self._data.items()},
            {k: self.metadata[k][start:end] for k in row_keys},
        )

    def select_rows(self, indices: Sequence[int]) -> TrainingInputBatch:
        """The given rows, in the given order, as a new batch (copies)."""
        row_keys = self._row_metadata_keys()
        return self._with_rows(
            {k: _select_field(v, indices) for k, v in self._data.items()},
            {k: [self.metadata[k][i] for i in indices] for k in row_keys},
        )

    def chunk(self, n: int) -> list[TrainingInputBatch]:
        """`n` consecutive equal parts; the row count must be divisible by `n` (pad first)."""
        if n <= 0 or len(self) % n != 0:
            raise ValueError(
                f"cannot chunk a batch of {len(self)} rows into {n} equal parts; "
                f"pad it to a multiple of {n} with pad_training_input_batch first"
            )
        size = len(self) // n
        return [self.slice(i * size, (i + 1) * size) for i in range(n)]

    def select(self, keys: Sequence[str]) -> TrainingInputBatch:
        """Only the given fields (metadata kept)."""
        missing = [k for k in keys if k not in self._data]
        if missing:
            raise KeyError(f"fields {missing} not in batch; available: {sorted(self._data)}")
        return TrainingInputBatch({k: self._data[k] for k in keys}, self._copy_metadata())

    def to(self, device: torch.device | str) -> TrainingInputBatch:
        return TrainingInputBatch({k: v.to(device) for k, v in self._data.items()}, self._copy_metadata())

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor fields (metadata not counted)."""
        return sum(
            sum(t.nbytes for t in v) if isinstance(v, TensorList) else v.nbytes for v in self._data.values()
        )

    @staticmethod
    def merge(parts: Sequence[TrainingInputBatch]) -> TrainingInputBatch:
        """One batch with the fields of all `parts`, which hold the same rows; metadata of the first.

        `ValueError` when the parts differ in rows or share a field name.
        """
        data: dict[str, Field] = {}
        for i, part in enumerate(parts):
            repeated = sorted(set(part.keys()) & set(data))
            if repeated:
                raise ValueError(f"cannot merge: part {i} repeats the fields {repeated}")
            data.update(part.items())
        return TrainingInputBatch(data, parts[0]._copy_metadata())

    @staticmethod
    def cat(batches: Sequence[TrainingInputBatch]) -> TrainingInputBatch:
        """Rows of all batches in order. Fields must match; shared metadata comes from the first batch."""
        if not batches:
            raise ValueError("TrainingInputBatch.cat needs at least one batch")
        keys = list(batches[0].keys())
        for i, b in enumerate(batches[1:], start=1):
            if set(b.keys()) != set(keys):
                raise ValueError(
                    f"cannot cat: batch 0 has fields {sorted(keys)}, batch {i} has {sorted(b.keys())}"
                )
        row_keys = batches[0]._row_metadata_keys()
        for i, b in enumerate(batches[1:], start=1):
            if set(b._row_metadata_keys()) != set(row_keys):
                raise ValueError(
                    f"cannot cat: batch 0 has per-row metadata {sorted(row_keys)}, "
                    f"batch {i} has {sorted(b._row_metadata_keys())}"
                )
        data = {k: _cat_fields([b[k] for b in batches], k) for k in keys}
        row_meta = {k: [x for b in batches for x in b.metadata[k]] for k in row_keys}
        return batches[0]._with_rows(data, row_meta)


def pad_training_input_batch(batch: TrainingInputBatch, pad_size: int) -> TrainingInputBatch:
    """A NEW batch with `pad_size` rows appended, each a copy of row 0.

    On pad rows `loss_mask`, `response_mask` and `advantages` (when present) are
    zero, so they contribute nothing to any loss; `uids` (and `trajectory_ids`)
    get unique pad ids, `is_last_step` is True, other per-row metadata copies
    row 0. The new batch has `metadata["pad_size"] = pad_size`. The input is
    never mutated; `pad_size == 0` returns the input itself.
    """
    if pad_size < 0:
        raise ValueError(f"pad_size must be >= 0, got {pad_size}")
    if pad_size == 0:
        return batch
    if len(batch) == 0:
        raise ValueError("cannot pad an empty batch: pad rows are copies of a real row")
    data: dict[str, Field] = {}
    for key, value in batch.items():
        if isinstance(value, TensorList):
            pad_rows = [value[0].clone() for _ in range(pad_size)]
            if key in PAD_ZEROED_FIELDS:
                pad_rows = [torch.zeros_like(t) for t in pad_rows]
            data[key] = TensorList(list(value) + pad_rows)
        else:
            pad_rows = value[:1].expand(pad_size, *value.shape[1:])
            if key in PAD_ZEROED_FIELDS:
                pad_rows = torch.zeros_like(pad_rows)
            data[key] = torch.cat([value, pad_rows], dim=0)
    pad_ids = [f"{PAD_UID_PREFIX}{i}" for i in range(pad_size)]
    row_meta = {}
    for key in batch._row_metadata_keys():
        values = batch.metadata[key]
        if key in ("uids", "trajectory_ids"):
            extra = pad_ids
        elif key == "is_last_step":
            extra = [True] * pad_size
        else:
            extra = [copy.deepcopy(values[0]) for _ in range(pad_size)]
        row_meta[key] = list(values) + extra
    padded = batch._with_rows(data, row_meta)
    padded.metadata["pad_size"] = pad_size
    return padded


def row_groups(prefix_group: torch.Tensor | None, num_rows: int) -> list[list[int]]:
    """Row indices grouped by `prefix_group` (each row alone when None), groups in order of first row."""
    if prefix_group is None:
        return [[i] for i in range(num_rows)]
    groups: dict[int, list[int]] = {}
    for i, group in enumerate(prefix_group.tolist()):
        groups.setdefault(group, []).append(i)
    return list(groups.values())


def longest_rows(attention_mask: torch.Tensor, groups: list[list[int]]) -> list[int]:
    """Each group's row with the most attended tokens (the one a prefix group is computed as)."""
    lengths = attention_mask.sum(-1).tolist()
    return [max(group, key=lengths.__getitem__) for group in groups]


def partition_rows(
    batch: TrainingInputBatch, dp_size: int, balance: bool, cost_weight: float | None = None
) -> list[list[int]]:
    """Row indices of each DP rank, for a batch whose length is a multiple of `dp_size`.

    The unit of assignment is a prefix group (`prefix_group` field; each row alone without
    it): its rows are computed as one sequence, so they go to one rank. Units are assigned by
    `split_train_data_by_dp`'s rule over their longest row's attended tokens, balanced by
    `attention_aware_cost(cost_weight)` when given (strided when there are fewer units than
    ranks, leaving some ranks without rows). The driver-side split
    and the delayed split (each worker) both call this, and it is deterministic, so every rank
    gets the same rows either way.
    """
    n = len(batch)
    if n % dp_size != 0:
        raise ValueError(f"a batch of {n} rows cannot be split over {dp_size} ranks; pad it first")
    units = row_groups(batch.get("prefix_group"), n)
    sequences, attention_mask = batch["sequences"], batch["attention_mask"]
    tokens = [sequences[i][attention_mask[i].bool()] for i in longest_rows(attention_mask, units)]
    if len(units) >= dp_size:
        cost = attention_aware_cost(cost_weight) if cost_weight else None
        split = split_train_data_by_dp({"tokens": tokens}, dp_size, balance, cost)
        parts = [part["partition"] for part in split]
    else:
        parts = [list(range(r, len(units), dp_size)) for r in range(dp_size)]
    return [sorted(i for u in part for i in units[u]) for part in parts]
