import math

import pytest
import torch

from skyrl.train.algorithms import get_policy_loss, off_policy_correction, value_loss

F64 = torch.float64


def loss_and_grad(name, ratio, advantages, mask=None, **options):
    """Loss and d loss / d log_probs with old_log_probs = 0, so r_t = `ratio`."""
    ratio = torch.tensor([ratio], dtype=F64)
    log_probs = ratio.log().requires_grad_()
    advantages = torch.tensor([advantages], dtype=F64)
    mask = torch.ones_like(ratio) if mask is None else torch.tensor([mask], dtype=F64)
    loss, metrics = get_policy_loss(name)(log_probs, torch.zeros_like(ratio), advantages, mask, **options)
    (grad,) = torch.autograd.grad(loss.sum(), log_probs)
    return loss[0], grad[0], metrics


def test_regular_ppo_clip_hand_computed():
    loss, grad, metrics = loss_and_grad("regular", [1.5, 0.5, 1.1, 0.7], [1.0, 1.0, -1.0, -1.0])
    # r=1.5,A=1 clipped to 1.2; r=0.5,A=1 unclipped; r=1.1,A=-1 inside; r=0.7,A=-1 clipped to 0.8
    torch.testing.assert_close(loss, torch.tensor([-1.2, -0.5, 1.1, 0.8], dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([0.0, -0.5, 1.1, 0.0], dtype=F64))
    assert metrics["clip_frac"].item() == pytest.approx(0.5)
    assert metrics["ratio_max"].item() == pytest.approx(1.5)
    assert metrics["ratio_min"].item() == pytest.approx(0.5)
    assert metrics["ratio_mean"].item() == pytest.approx(0.95)


def test_regular_uses_separate_low_and_high_clip():
    loss, _, _ = loss_and_grad("regular", [1.5, 0.5], [1.0, -1.0], eps_clip_low=0.1, eps_clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([-1.28, 0.9], dtype=F64))


def test_dual_clip_caps_negative_advantage_loss_at_clip_ratio_c():
    loss, grad, metrics = loss_and_grad("dual_clip", [5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], clip_ratio_c=3.0)
    # r=5,A=-1: regular loss 5 capped at 3; r=2,A=-1: 2 < 3; r=5,A=1: clipped to -1.2, no cap for A>0
    torch.testing.assert_close(loss, torch.tensor([3.0, 2.0, -1.2], dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([0.0, 2.0, 0.0], dtype=F64))
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 3)


def test_dual_clip_rejects_clip_ratio_c_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        loss_and_grad("dual_clip", [1.0], [1.0], clip_ratio_c=1.0)


def test_gspo_uses_the_sequence_ratio_for_every_token():
    log_probs = torch.tensor([[0.1, 0.3, 7.0], [0.5, 0.7, 0.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=F64)
    advantages = torch.ones(2, 3, dtype=F64)
    loss, metrics = get_policy_loss("gspo")(
        log_probs, torch.zeros_like(log_probs), advantages, mask, eps_clip_low=0.2, eps_clip_high=0.28
    )
    (grad,) = torch.autograd.grad(loss.sum(), log_probs)
    # row 0: s = exp(mean(0.1, 0.3)) = exp(0.2) inside the clip range; row 1: s = exp(0.4) > 1.28, clipped
    s0 = math.exp(0.2)
    torch.testing.assert_close(loss, torch.tensor([[-s0, -s0, 0.0], [-1.28, -1.28, -1.28]], dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([[-s0, -s0, 0.0], [0.0, 0.0, 0.0]], dtype=F64))
    assert metrics["clip_frac"].item() == pytest.approx(3 / 5)


def test_cispo_clips_and_detaches_the_importance_weight_but_keeps_every_gradient():
    ratio = torch.tensor([2.0, 0.5], dtype=F64)
    log_probs = torch.tensor([-1.0, -2.0], dtype=F64, requires_grad=True)
    old_log_probs = log_probs.detach() - ratio.log()
    advantages = torch.tensor([1.0, -2.0], dtype=F64)
    loss, metrics = get_policy_loss("cispo")(
        log_probs, old_log_probs, advantages, torch.ones(2, dtype=F64), eps_clip_low=1.0, eps_clip_high=0.2
    )
    (grad,) = torch.autograd.grad(loss.sum(), log_probs)
    # weights clip(2.0) = 1.2 and 0.5; L = -w A log pi; dL/dlog pi = -w A
    torch.testing.assert_close(loss, torch.tensor([1.2, -2.0], dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([-1.2, 1.0], dtype=F64))
    assert metrics["clip_frac"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("name", ["regular", "dual_clip", "gspo", "cispo"])
def test_masked_tokens_give_zero_loss_and_stay_out_of_metrics(name):
    log_probs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=F64, requires_grad=True)
    # masked-out tokens carry a placeholder old log-prob that would overflow exp()
    old_log_probs = torch.tensor([[-1.1, -1e4], [-1e4, -1e4]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=F64)
    advantages = torch.tensor([[1.0, 5.0], [1e6, 1e6]], dtype=F64)
    loss, metrics = get_policy_loss(name)(log_probs, old_log_probs, advantages, mask)
    (grad,) = torch.autograd.grad(loss.sum(), log_probs)
    assert loss[mask == 0].eq(0).all()
    assert grad[mask == 0].eq(0).all() and grad.isfinite().all()
    assert metrics["ratio_max"].item() == pytest.approx(math.exp(0.1))
    assert metrics["ratio_min"].item() == pytest.approx(math.exp(0.1))


def test_metrics_of_an_all_masked_micro_batch_are_finite():
    log_probs = torch.zeros(2, 3, dtype=F64)
    _, metrics = get_policy_loss("regular")(log_probs, log_probs, log_probs, torch.zeros_like(log_probs))
    assert all(torch.isfinite(v) for v in metrics.values())


def test_value_loss_takes_the_larger_of_clipped_and_unclipped_error():
    values = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    old_values = torch.tensor([0.5, 0.5, 0.0], dtype=F64)
    returns = torch.tensor([1.5, 0.0, 0.0], dtype=F64)
    mask = torch.tensor([1.0, 1.0, 0.0], dtype=F64)
    loss, metrics = value_loss(values, old_values, returns, mask, value_clip=0.2)
    # token 0: max((1-1.5)^2, (0.7-1.5)^2) = 0.64; token 1: max(4, 0.49) = 4; token 2 masked
    torch.testing.assert_close(loss, torch.tensor([0.32, 2.0, 0.0], dtype=F64))
    assert metrics["vf_clip_frac"].item() == pytest.approx(0.5)
    unclipped, _ = value_loss(values, old_values, returns, mask, value_clip=None)
    torch.testing.assert_close(unclipped, torch.tensor([0.125, 2.0, 0.0], dtype=F64))


def test_off_policy_weights_cap_and_mask_by_the_trainer_over_engine_ratio():
    loss_mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    rollout = torch.zeros(2, 4)
    old = torch.log(torch.tensor([[3.0, 1.0, 0.25, 9.0], [1.5, 1.5, 9.0, 9.0]]))  # rho per token
    weights, mask, m = off_policy_correction(old, rollout, loss_mask, "tis", tis_cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.0, 0.25, 0.0], [1.5, 1.5, 0.0, 0.0]]))
    assert torch.equal(mask, loss_mask)
    weights, mask, m = off_policy_correction(old, rollout, loss_mask, "mis", mis_low=0.5, mis_high=2.0)
    assert mask.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]  # 3 and 0.25 leave the loss
    assert m["is_masked_fraction"] == pytest.approx(2 / 5) and torch.equal(weights, mask)
    # sequence level: row 0's product is 3 * 1 * 0.25 = 0.75, row 1's 2.25 (the masked-out token ignored)
    weights, _, _ = off_policy_correction(old, rollout, loss_mask, "seq_tis", tis_cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.75, 0.75, 0.75, 0.0], [2.0, 2.0, 0.0, 0.0]]))
    _, mask, _ = off_policy_correction(old, rollout, loss_mask, "seq_mis", mis_low=0.5, mis_high=2.0)
    assert mask.tolist() == [[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("mode", ["none", "tis", "mis", "seq_tis", "seq_mis"])
def test_with_identical_logprobs_every_correction_is_none(mode):
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 5, generator=gen)
    loss_mask = (torch.rand(3, 5, generator=gen) > 0.3).float()
    weights, mask, m = off_policy_correction(logprobs, logprobs.clone(), loss_mask, mode)
    assert torch.equal(mask, loss_mask) and torch.equal(weights, loss_mask)
    assert m["is_weight_mean"] == 1 and m["is_masked_fraction"] == 0


def test_an_unknown_correction_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown off-policy correction 'icepop'.*'seq_mis'"):
        off_policy_correction(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "icepop")
