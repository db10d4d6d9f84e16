import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl.train.algorithms import (
    compute_stepwise_advantages,
    gae,
    get_advantage_estimator,
    grpo,
    reinforce_plus_plus,
    rloo,
)


def outcome_rewards(scores, length=3):
    """Each row's score on its last token, full response mask."""
    rewards = torch.zeros(len(scores), length, dtype=torch.float64)
    rewards[:, -1] = torch.tensor(scores, dtype=torch.float64)
    return rewards, torch.ones_like(rewards)


def test_grpo_normalises_by_group_mean_and_unbiased_std():
    rewards, mask = outcome_rewards([1.0, 0.0, 1.0, 1.0])
    advantages, returns = grpo(rewards, mask, ["p"] * 4)
    # mean 0.75, unbiased std 0.5
    expected = torch.tensor([0.5, -1.5, 0.5, 0.5], dtype=torch.float64)[:, None].expand(4, 3)
    torch.testing.assert_close(advantages, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(returns, advantages)


def test_grpo_groups_by_uid_and_zeroes_singletons_and_masked_tokens():
    rewards, mask = outcome_rewards([1.0, 0.0, 3.0, 5.0])
    mask[1, 1:] = 0
    advantages, _ = grpo(rewards, mask, ["a", "a", "b", "c"])
    expected = torch.tensor(
        [[0.70710678] * 3, [-0.70710678, 0.0, 0.0], [0.0] * 3, [0.0] * 3], dtype=torch.float64
    )
    torch.testing.assert_close(advantages, expected, rtol=1e-5, atol=1e-12)


def test_dr_grpo_only_subtracts_the_group_mean():
    rewards, mask = outcome_rewards([1.0, 0.0, 1.0, 1.0])
    advantages, _ = grpo(rewards, mask, ["p"] * 4, norm_adv_by_std_in_grpo=False)
    expected = torch.tensor([0.25, -0.75, 0.25, 0.25], dtype=torch.float64)[:, None].expand(4, 3)
    torch.testing.assert_close(advantages, expected)


def test_rloo_subtracts_the_mean_of_the_other_samples():
    rewards, mask = outcome_rewards([1.0, 0.0, 1.0, 1.0, 7.0])
    advantages, _ = rloo(rewards, mask, ["p"] * 4 + ["q"])
    expected = torch.tensor([1 / 3, -1.0, 1 / 3, 1 / 3, 0.0], dtype=torch.float64)[:, None].expand(5, 3)
    torch.testing.assert_close(advantages, expected)


def test_outcome_score_is_the_sum_of_the_row_token_rewards():
    rewards = torch.tensor([[0.5, 0.0, 0.5], [0.0, 0.0, 0.0]], dtype=torch.float64)
    advantages, _ = rloo(rewards, torch.ones_like(rewards), ["p", "p"])
    torch.testing.assert_close(advantages[:, 0], torch.tensor([1.0, -1.0], dtype=torch.float64))


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    advantages, returns = gae(rewards, torch.ones_like(rewards), ["p"], values, gamma=0.9, lambd=0.5)
    # A2 = 1 - 0.7; A1 = 0.9*0.7 - 0.6 + 0.45*A2; A0 = 0.9*0.6 - 0.5 + 0.45*A1
    torch.testing.assert_close(advantages, torch.tensor([[0.11425, 0.165, 0.3]], dtype=torch.float64))
    torch.testing.assert_close(returns, torch.tensor([[0.61425, 0.765, 1.0]], dtype=torch.float64))


def test_gae_with_gamma_and_lambda_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    advantages, returns = gae(rewards, mask, ["p"], values)
    torch.testing.assert_close(advantages, torch.tensor([[2.5, 2.4, 0.3, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(returns, torch.tensor([[3.0, 3.0, 1.0, 0.0]], dtype=torch.float64))


def test_gae_without_values_raises():
    rewards, mask = outcome_rewards([1.0])
    with pytest.raises(ValueError, match="critic"):
        gae(rewards, mask, ["p"])


def reference_gae(rewards, values, mask, gamma, lambd):
    """Textbook GAE per row over the masked-in tokens only, with Python loops."""
    advantages = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[i, t]]
        last_advantage = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            next_value = values[i, steps[k + 1]].item() if k + 1 < len(steps) else 0.0
            delta = rewards[i, t].item() + gamma * next_value - values[i, t].item()
            last_advantage = delta + gamma * lambd * last_advantage
            advantages[i, t] = last_advantage
    return advantages


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    length=st.integers(1, 7),
    gamma=st.floats(0.0, 1.0),
    lambd=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_gae_matches_reference_loop_on_random_masked_inputs(rows, length, gamma, lambd, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(rows, length, generator=g, dtype=torch.float64)
    values = torch.randn(rows, length, generator=g, dtype=torch.float64)
    mask = torch.randint(0, 2, (rows, length), generator=g)  # holes skip, like observation tokens
    advantages, returns = gae(rewards, mask, list(range(rows)), values, gamma=gamma, lambd=lambd)
    expected = reference_gae(rewards, values, mask, gamma, lambd)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, (expected + values) * mask)


def test_reinforce_plus_plus_whitens_discounted_returns_over_the_batch():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    advantages, returns = reinforce_plus_plus(rewards, torch.ones_like(rewards), ["p", "q"], gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([[0.5, 1.0], [0.0, 0.0]], dtype=torch.float64))
    # tokens 0.5, 1, 0, 0: mean 0.375, std sqrt(0.171875) = 0.4145781
    expected = torch.tensor([[0.3015113, 1.5075567], [-0.9045340, -0.9045340]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-7)


def test_reinforce_plus_plus_group_baseline_subtracts_group_mean_at_last_token():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    advantages, returns = reinforce_plus_plus(rewards, mask, ["p", "p"], group_baseline=True)
    torch.testing.assert_close(returns, torch.tensor([[0.5, 0.5], [-0.5, 0.0]], dtype=torch.float64))
    # tokens 0.5, 0.5, -0.5: mean 1/6, std sqrt(2)/3
    expected = torch.tensor([[0.70710678, 0.70710678], [-1.41421356, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-7)


def test_stepwise_broadcasts_each_trajectory_advantage_to_all_its_steps():
    # trajectories: A (1 step, prompt p0), B (2 steps, p0), C (4 steps, p1), D (1 step, p1); rows shuffled
    rows = [("C", 2), ("B", 1), ("A", 0), ("C", 0), ("D", 0), ("C", 3), ("B", 0), ("C", 1)]
    last_step = {"A": 0, "B": 1, "C": 3, "D": 0}
    uid = {"A": "p0", "B": "p0", "C": "p1", "D": "p1"}
    # C earns 0.5 on steps 1 and 3: its total 1.0, not its last step's 0.5, is what counts
    step_reward = {("A", 0): 1.0, ("C", 1): 0.5, ("C", 3): 0.5}
    lengths = [3, 5, 2, 4, 1, 5, 2, 3]
    mask = torch.tensor([[1] * n + [0] * (5 - n) for n in lengths])
    rewards = torch.zeros(len(rows), 5, dtype=torch.float64)
    for i, key in enumerate(rows):
        rewards[i, lengths[i] - 1] = step_reward.get(key, 0.0)

    advantages, returns = compute_stepwise_advantages(
        "rloo",
        rewards,
        mask,
        uids=[uid[t] for t, _ in rows],
        trajectory_ids=[t for t, _ in rows],
        is_last_step=[s == last_step[t] for t, s in rows],
    )
    # RLOO in each pair of trajectories: totals A=1, B=0 -> +1, -1; C=1, D=0 -> +1, -1
    per_row = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(advantages, per_row[:, None] * mask)
    torch.testing.assert_close(returns, advantages)


@settings(max_examples=30, deadline=None)
@given(scores=st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=1, max_size=8), seed=st.integers(0, 1000))
def test_stepwise_with_single_step_trajectories_equals_the_plain_estimator(scores, seed):
    g = torch.Generator().manual_seed(seed)
    n = len(scores)
    lengths = torch.randint(1, 5, (n,), generator=g)
    mask = (torch.arange(4)[None, :] < lengths[:, None]).long()
    rewards = torch.zeros(n, 4, dtype=torch.float64)
    rewards[torch.arange(n), lengths - 1] = torch.tensor(scores, dtype=torch.float64)
    uids = [f"p{i % 3}" for i in range(n)]
    stepwise, _ = compute_stepwise_advantages(
        grpo, rewards, mask, uids, [f"t{i}" for i in range(n)], [True] * n
    )
    plain, _ = grpo(rewards, mask, uids)
    torch.testing.assert_close(stepwise, plain)


def test_stepwise_rejects_trajectories_without_exactly_one_last_step():
    rewards, mask = outcome_rewards([1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="exactly one"):
        compute_stepwise_advantages("grpo", rewards, mask, ["p"] * 3, ["a", "a", "b"], [False, False, True])
    with pytest.raises(ValueError, match="exactly one"):
        compute_stepwise_advantages("grpo", rewards, mask, ["p"] * 3, ["a", "a", "b"], [True, True, True])
    with pytest.raises(ValueError, match="trajectory_ids has 2 entries"):
        compute_stepwise_advantages("grpo", rewards, mask, ["p"] * 3, ["a", "b"], [True, True, True])


def test_grpo_gives_zero_not_nan_when_all_scores_in_a_group_are_equal():
    rewards, mask = outcome_rewards([1.0, 1.0, 1.0])
    advantages, _ = grpo(rewards, mask, ["p"] * 3)
    assert torch.equal(advantages, torch.zeros_like(advantages))


@pytest.mark.parametrize("name", ["gae", "grpo", "rloo", "reinforce++"])
def test_an_index_of_the_wrong_length_names_both_lengths(name):
    rewards = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="index has 2 entries but rewards has 3 rows"):
        get_advantage_estimator(name)(rewards, torch.ones(3, 2), ["a", "b"], torch.zeros(3, 2))


@pytest.mark.parametrize(
    ("name", "options"), [("gae", {"gamma": 0.9, "lambd": 0.5}), ("reinforce++", {"gamma": 0.9})]
)
def test_estimators_that_do_not_group_accept_no_index(name, options):
    """Peer suites (SkyRL's, miles') call GAE and REINFORCE++ with index=None: the same result as with one."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7], [0.1, 0.2, 0.3]], dtype=torch.float64)
    estimator = get_advantage_estimator(name)
    expected = estimator(rewards, torch.ones_like(rewards), ["a", "b"], values, **options)
    got = estimator(rewards, torch.ones_like(rewards), None, values, **options)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("name", "options"),
    [("grpo", {}), ("rloo", {}), ("reinforce++", {"group_baseline": True})],
)
def test_estimators_that_group_name_themselves_when_the_index_is_missing(name, options):
    rewards, mask = outcome_rewards([1.0, 0.0])
    with pytest.raises(ValueError, match=f"advantage estimator '{name}.*groups rows by prompt: pass index"):
        get_advantage_estimator(name)(rewards, mask, None, **options)
