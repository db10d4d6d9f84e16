import math

import pytest
import torch

from skyrl.train.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_to_rewards,
    entropy_from_logprobs,
    kl_penalty,
)

F64 = torch.float64


def test_kl_estimators_hand_computed():
    log_probs = torch.tensor([-1.0, -2.0, -1.0], dtype=F64)
    ref_log_probs = torch.tensor([-2.0, -1.0, -1.0], dtype=F64)  # log r = -1, 1, 0
    torch.testing.assert_close(
        kl_penalty(log_probs, ref_log_probs, "k1"), torch.tensor([1.0, -1.0, 0.0], dtype=F64)
    )
    torch.testing.assert_close(
        kl_penalty(log_probs, ref_log_probs, "k2"), torch.tensor([0.5, 0.5, 0.0], dtype=F64)
    )
    # k3 = r - 1 - log r: e^-1 - 1 + 1, e - 1 - 1, 0
    torch.testing.assert_close(
        kl_penalty(log_probs, ref_log_probs, "k3"), torch.tensor([math.exp(-1), math.e - 2, 0.0], dtype=F64)
    )


def test_k3_is_clamped_to_its_bound_with_finite_gradient():
    log_probs = torch.tensor([-16.0, -101.0], dtype=F64, requires_grad=True)
    ref_log_probs = torch.tensor([-1.0, -1.0], dtype=F64)  # log r = 15, 100
    kl = kl_penalty(log_probs, ref_log_probs, "k3", k3_bound=5.0)
    torch.testing.assert_close(kl, torch.tensor([5.0, 5.0], dtype=F64))
    (grad,) = torch.autograd.grad(kl.sum(), log_probs)
    torch.testing.assert_close(grad, torch.zeros(2, dtype=F64))
    assert kl_penalty(log_probs, ref_log_probs, "k3").max().item() == 10.0


def test_unknown_kl_estimator_raises_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"k1.*k2.*k3"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_kl_penalty_is_subtracted_from_rewards_on_response_tokens():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    kl = torch.tensor([[0.5, 0.5, 0.5]])
    penalised = apply_kl_penalty_to_rewards(rewards, kl, 0.1, torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(penalised, torch.tensor([[-0.05, 0.95, 0.0]]))


def test_adaptive_kl_controller_raises_coefficient_above_target_and_lowers_it_below():
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=10)
    controller.update(current_kl=2.0, n_steps=5)  # error clipped to +0.2: x (1 + 0.2 * 5/10)
    assert controller.value == pytest.approx(0.11)
    controller.update(current_kl=0.5, n_steps=5)  # error -0.5 clipped to -0.2: x 0.9
    assert controller.value == pytest.approx(0.099)
    controller.update(current_kl=1.0, n_steps=5)  # on target: unchanged
    assert controller.value == pytest.approx(0.099)


def test_fixed_kl_controller_never_changes():
    controller = FixedKLController(0.05)
    controller.update(current_kl=100.0, n_steps=10)
    assert controller.value == 0.05


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    return entropy_from_logprobs(logits.log_softmax(-1))


def test_entropy_matches_definition_and_is_stable_for_large_and_masked_logits():
    torch.testing.assert_close(
        entropy_from_logits(torch.zeros(2, 4, dtype=F64)), torch.full((2,), math.log(4), dtype=F64)
    )
    logits = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0), dtype=F64)
    probs = logits.softmax(-1)
    torch.testing.assert_close(entropy_from_logits(logits), -(probs * probs.log()).sum(-1))
    huge = torch.tensor([[1e4, 0.0, 1e4]], dtype=torch.float32)
    torch.testing.assert_close(entropy_from_logits(huge), torch.tensor([math.log(2)]))
    masked = torch.tensor([[0.0, -1e9, 0.0]], dtype=torch.float32)  # allowed_token_ids' finite mask
    torch.testing.assert_close(entropy_from_logits(masked), torch.tensor([math.log(2)]))
