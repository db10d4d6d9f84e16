import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl.train.algorithms import (
    REDUCTIONS,
    get_policy_loss,
    iter_micro_batches,
    loss_scale_for_reduction,
    num_micro_batches,
    reduce_loss,
    reduction_counts,
)
from skyrl.train.training_batch import TrainingInputBatch, pad_training_input_batch

F64 = torch.float64
POLICY_LOSSES = ["regular", "dual_clip", "gspo", "cispo"]

# rows: a full sequence, a one-token sequence, and a row with nothing to train on (like a pad row)
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]], dtype=F64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)


def test_reduce_loss_hand_computed():
    assert reduce_loss(LOSS, MASK, "token_mean").item() == pytest.approx((6 + 4) / 4)
    assert reduce_loss(LOSS, MASK, "sequence_mean").item() == pytest.approx((2 + 4) / 2)
    assert reduce_loss(LOSS, MASK, "seq_mean_token_sum_norm", max_seq_len=4).item() == pytest.approx(
        (6 / 4 + 4 / 4) / 2
    )


def test_loss_scales_hand_computed():
    torch.testing.assert_close(loss_scale_for_reduction(MASK, "token_mean"), MASK / 4)
    expected = torch.tensor([[1 / 6, 1 / 6, 1 / 6], [1 / 2, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(loss_scale_for_reduction(MASK, "sequence_mean"), expected)
    torch.testing.assert_close(
        loss_scale_for_reduction(MASK, "seq_mean_token_sum_norm", max_seq_len=4), MASK / 8
    )


def test_per_micro_batch_means_would_be_wrong_but_the_scaled_sum_is_exact():
    micro_batches = [slice(0, 1), slice(1, 3)]
    naive = sum(reduce_loss(LOSS[s], MASK[s], "token_mean") for s in micro_batches) / 2
    assert naive.item() == pytest.approx((2 + 4) / 2)  # != the token mean 2.5
    scale = loss_scale_for_reduction(MASK, "token_mean")
    assert sum((LOSS[s] * scale[s]).sum() for s in micro_batches).item() == pytest.approx(2.5)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_an_all_masked_batch_reduces_to_zero_without_nan(reduction):
    mask = torch.zeros(2, 3, dtype=F64)
    scale = loss_scale_for_reduction(mask, reduction, max_seq_len=3)
    assert torch.equal(scale, torch.zeros_like(scale))
    assert reduce_loss(LOSS[:2], mask, reduction, max_seq_len=3).item() == 0.0


def test_unknown_reduction_and_missing_max_seq_len_raise():
    with pytest.raises(ValueError, match="token_mean"):
        loss_scale_for_reduction(MASK, "mean")
    with pytest.raises(ValueError, match="max_seq_len"):
        reduce_loss(LOSS, MASK, "seq_mean_token_sum_norm")


def random_mini_batch(seed, rows, length):
    g = torch.Generator().manual_seed(seed)
    loss_mask = (torch.rand(rows, length, generator=g) < 0.7).to(F64)
    loss_mask[torch.rand(rows, generator=g) < 0.2] = 0  # rows with nothing to train on
    return TrainingInputBatch(
        {
            "row": torch.arange(rows),
            "log_probs": -torch.rand(rows, length, generator=g, dtype=F64) * 2,
            "old_log_probs": -torch.rand(rows, length, generator=g, dtype=F64) * 2,
            "advantages": torch.randn(rows, length, generator=g, dtype=F64) * loss_mask,
            "loss_mask": loss_mask,
        },
        {"uids": [f"u{i}" for i in range(rows)]},
    )


def loss_and_grad_on_whole_batch(batch, loss_name, reduction, max_seq_len):
    log_probs = batch["log_probs"].clone().requires_grad_()
    per_token, _ = get_policy_loss(loss_name)(
        log_probs, batch["old_log_probs"], batch["advantages"], batch["loss_mask"]
    )
    loss = reduce_loss(per_token, batch["loss_mask"], reduction, max_seq_len)
    (grad,) = torch.autograd.grad(loss, log_probs)
    return loss.detach(), grad


def loss_and_grad_split(batch, loss_name, reduction, max_seq_len, dp_size, micro_batches_per_rank):
    """What the trainer does: pad, scale once, shard across ranks, micro-batch, sum; grads summed per row."""
    padded = pad_training_input_batch(batch, (-len(batch)) % dp_size)
    padded["loss_scale"] = loss_scale_for_reduction(padded["loss_mask"], reduction, max_seq_len)
    total_loss = torch.zeros((), dtype=F64)
    grad = torch.zeros_like(batch["log_probs"])
    for shard in padded.chunk(dp_size):
        micro_batch_size = -(-len(shard) // micro_batches_per_rank)
        for micro in iter_micro_batches(shard, micro_batch_size):
            log_probs = micro["log_probs"].clone().requires_grad_()
            per_token, _ = get_policy_loss(loss_name)(
                log_probs, micro["old_log_probs"], micro["advantages"], micro["loss_mask"]
            )
            loss = (per_token * micro["loss_scale"]).sum()
            (micro_grad,) = torch.autograd.grad(loss, log_probs)
            total_loss += loss.detach()
            # a pad row copies a real row; its gradient lands on that row and must be zero
            grad.index_add_(0, micro["row"], micro_grad)
    return total_loss, grad


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 9),
    length=st.integers(1, 6),
    loss_name=st.sampled_from(POLICY_LOSSES),
    reduction=st.sampled_from(REDUCTIONS),
    dp_size=st.sampled_from([1, 2, 4]),
    micro_batches_per_rank=st.sampled_from([1, 2, 3]),
)
def test_loss_and_gradient_are_invariant_to_dp_sharding_and_micro_batching(
    seed, rows, length, loss_name, reduction, dp_size, micro_batches_per_rank
):
    batch = random_mini_batch(seed, rows, length)
    max_seq_len = length + 2
    expected_loss, expected_grad = loss_and_grad_on_whole_batch(batch, loss_name, reduction, max_seq_len)
    loss, grad = loss_and_grad_split(
        batch, loss_name, reduction, max_seq_len, dp_size, micro_batches_per_rank
    )
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-12)


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    loss_name=st.sampled_from(POLICY_LOSSES),
    reduction=st.sampled_from(REDUCTIONS),
)
def test_pad_rows_contribute_nothing_whatever_their_values(seed, loss_name, reduction):
    batch = random_mini_batch(seed, rows=5, length=4)
    padded = pad_training_input_batch(batch, 3)
    g = torch.Generator().manual_seed(seed + 1)

    def loss_and_grad(log_probs, old_log_probs, advantages):
        log_probs = log_probs.clone().requires_grad_()
        scale = loss_scale_for_reduction(padded["loss_mask"], reduction, max_seq_len=4)
        per_token, _ = get_policy_loss(loss_name)(log_probs, old_log_probs, advantages, padded["loss_mask"])
        loss = (per_token * scale).sum()
        return loss.detach(), torch.autograd.grad(loss, log_probs)[0]

    base = loss_and_grad(padded["log_probs"], padded["old_log_probs"], padded["advantages"])
    garbled = [padded[k].clone() for k in ("log_probs", "old_log_probs", "advantages")]
    for t in garbled:
        t[5:] = torch.randn(3, 4, generator=g, dtype=F64) * 50
    changed = loss_and_grad(*garbled)
    assert torch.equal(base[0], changed[0])
    assert torch.equal(base[1], changed[1])
    assert changed[1][5:].eq(0).all()


def test_num_micro_batches_is_ceil_division():
    assert [num_micro_batches(n, 3) for n in (0, 1, 3, 4, 6, 7)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="micro_batch_size"):
        num_micro_batches(4, 0)


def test_iter_micro_batches_yields_consecutive_slices_with_a_ragged_last_one():
    batch = random_mini_batch(0, rows=7, length=2)
    micro = list(iter_micro_batches(batch, 3))
    assert [len(m) for m in micro] == [3, 3, 1]
    assert [m.metadata["uids"] for m in micro] == [["u0", "u1", "u2"], ["u3", "u4", "u5"], ["u6"]]
    torch.testing.assert_close(torch.cat([m["log_probs"] for m in micro]), batch["log_probs"])


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_scale_from_summed_shard_counts_equals_the_whole_batch_scale(reduction):
    mask = (torch.rand(7, 5, generator=torch.Generator().manual_seed(3)) > 0.4).to(F64)
    mask[4] = 0  # a pad-like row
    whole = loss_scale_for_reduction(mask, reduction, max_seq_len=5)
    shards = [mask[:3], mask[3:5], mask[5:]]
    counts = sum(reduction_counts(s) for s in shards)
    per_shard = torch.cat([loss_scale_for_reduction(s, reduction, 5, counts=counts) for s in shards])
    torch.testing.assert_close(per_shard, whole)
