import copy
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl.train.training_batch import TensorList, TrainingInputBatch, pad_training_input_batch


def make_batch(n: int = 5, r: int = 3) -> TrainingInputBatch:
    g = torch.Generator().manual_seed(n * 100 + r)
    batch = TrainingInputBatch(
        {
            "sequences": torch.randint(0, 50, (n, 4 + r), generator=g),
            "loss_mask": torch.ones(n, r),
            "response_mask": torch.ones(n, r, dtype=torch.long),
            "advantages": torch.randn(n, r, generator=g),
            "ragged": TensorList([torch.arange(i + 1) for i in range(n)]),
        }
    )
    batch.metadata.update(
        uids=[f"u{i // 2}" for i in range(n)],
        trajectory_ids=[f"t{i}" for i in range(n)],
        step_ids=list(range(n)),
        is_last_step=[i % 2 == 1 for i in range(n)],
        response_length=r,
    )
    return batch


def snapshot(batch: TrainingInputBatch) -> tuple[dict, dict]:
    data = {
        k: (copy.deepcopy(v.tensors) if isinstance(v, TensorList) else v.clone()) for k, v in batch.items()
    }
    return data, copy.deepcopy(batch.metadata)


def assert_same(batch: TrainingInputBatch, snap: tuple[dict, dict]) -> None:
    data, metadata = snap
    assert set(batch.keys()) == set(data)
    for k, v in batch.items():
        if isinstance(v, TensorList):
            assert len(v) == len(data[k]) and all(torch.equal(a, b) for a, b in zip(v, data[k], strict=True))
        else:
            assert torch.equal(v, data[k]), k
    assert batch.metadata == metadata


def test_mismatched_row_counts_name_the_fields():
    with pytest.raises(ValueError, match=r"sequences=3.*loss_mask=2"):
        TrainingInputBatch({"sequences": torch.zeros(3, 4), "loss_mask": torch.zeros(2, 4)})


def test_setitem_with_wrong_row_count_names_the_field():
    batch = make_batch(4)
    with pytest.raises(ValueError, match="'values' has 3 rows but the batch has 4"):
        batch["values"] = torch.zeros(3, 2)


@pytest.mark.parametrize("value", [np.zeros(4), [1, 2, 3, 4], "abcd", None])
def test_setitem_refuses_what_the_constructor_refuses(value):
    batch = make_batch(4)
    with pytest.raises(TypeError, match=r"field 'x' must be a torch\.Tensor or TensorList"):
        batch["x"] = value


def test_merge_joins_the_fields_of_the_same_rows_and_refuses_repeats():
    a, b = make_batch(3).select(["sequences"]), TrainingInputBatch({"extra": torch.ones(3, 1)})
    merged = TrainingInputBatch.merge([a, b])
    assert set(merged.keys()) == {"sequences", "extra"} and merged.metadata == a.metadata
    with pytest.raises(ValueError, match="repeats the fields"):
        TrainingInputBatch.merge([a, a])
    with pytest.raises(ValueError, match="different row counts"):
        TrainingInputBatch.merge([a, TrainingInputBatch({"extra": torch.ones(2, 1)})])


def test_slice_keeps_rows_and_per_row_metadata_and_shared_metadata():
    batch = make_batch(5)
    part = batch.slice(1, 4)
    assert len(part) == 3
    assert torch.equal(part["sequences"], batch["sequences"][1:4])
    assert [t.tolist() for t in part["ragged"]] == [[0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert part.metadata["uids"] == ["u0", "u1", "u1"]
    assert part.metadata["response_length"] == 3


def test_chunk_splits_evenly_and_refuses_uneven():
    batch = make_batch(6)
    chunks = batch.chunk(3)
    assert [len(c) for c in chunks] == [2, 2, 2]
    assert TrainingInputBatch.cat(chunks).metadata["trajectory_ids"] == batch.metadata["trajectory_ids"]
    with pytest.raises(ValueError, match="pad it to a multiple of 4"):
        batch.chunk(4)


def test_cat_round_trips_slices():
    batch = make_batch(7)
    joined = TrainingInputBatch.cat([batch.slice(0, 2), batch.slice(2, 7)])
    assert_same(joined, snapshot(batch))


def test_cat_refuses_different_fields():
    a, b = make_batch(2), make_batch(2).select(["sequences"])
    with pytest.raises(ValueError, match="cannot cat"):
        TrainingInputBatch.cat([a, b])


def test_select_rows_reorders_fields_and_metadata():
    batch = make_batch(4)
    picked = batch.select_rows([3, 0])
    assert torch.equal(picked["advantages"], batch["advantages"][[3, 0]])
    assert picked["ragged"][0].tolist() == [0, 1, 2, 3]
    assert picked.metadata["step_ids"] == [3, 0]


def test_select_keeps_only_named_fields_and_names_missing_ones():
    batch = make_batch(3)
    assert list(batch.select(["loss_mask"]).keys()) == ["loss_mask"]
    with pytest.raises(KeyError, match="values"):
        batch.select(["values"])


def test_per_row_metadata_of_wrong_length_is_reported():
    batch = make_batch(3)
    batch.metadata["uids"] = ["a"]
    with pytest.raises(ValueError, match=r"metadata\['uids'\] is a list of 1 entries but the batch has 3"):
        batch.slice(0, 1)


def test_to_and_pickle_round_trip():
    batch = make_batch(4)
    snap = snapshot(batch)
    assert_same(batch.to("cpu"), snap)
    assert_same(pickle.loads(pickle.dumps(batch)), snap)


def test_pad_appends_masked_copies_and_pad_metadata():
    batch = make_batch(3)
    padded = pad_training_input_batch(batch, 2)
    assert len(padded) == 5
    assert padded.metadata["pad_size"] == 2
    assert torch.equal(padded["sequences"][3:], batch["sequences"][:1].expand(2, -1))
    for key in ("loss_mask", "response_mask", "advantages"):
        assert padded[key][3:].abs().sum() == 0, key
    assert padded.metadata["uids"][3:] == ["__pad__0", "__pad__1"]
    assert not set(padded.metadata["uids"][3:]) & set(batch.metadata["uids"])
    assert padded.metadata["is_last_step"][3:] == [True, True]
    assert padded.metadata["step_ids"][3:] == [0, 0]
    assert [t.tolist() for t in padded["ragged"]][3:] == [[0], [0]]


def test_pad_zero_returns_input_untouched_and_negative_is_an_error():
    batch = make_batch(3)
    snap = snapshot(batch)
    assert pad_training_input_batch(batch, 0) is batch
    assert "pad_size" not in batch.metadata
    assert_same(batch, snap)
    with pytest.raises(ValueError, match="pad_size must be >= 0, got -1"):
        pad_training_input_batch(batch, -1)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9), pad=st.integers(0, 9), dp=st.integers(1, 5))
def test_pad_never_mutates_input_and_pads_to_dp_multiple(n, pad, dp):
    batch = make_batch(n)
    snap = snapshot(batch)
    pad_size = (-n) % dp + pad * dp
    padded = pad_training_input_batch(batch, pad_size)
    assert_same(batch, snap)
    assert len(padded) % dp == 0
    assert padded["loss_mask"][n:].sum() == 0
    assert padded["loss_mask"][:n].sum() == batch["loss_mask"].sum()
    if pad_size == 0:
        assert padded is batch
        return
    # mutating the padded batch must not reach the input either
    padded["loss_mask"].add_(1)
    padded.metadata["uids"].append("x")
    assert_same(batch, snap)
