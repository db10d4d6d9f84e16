"""Advantage estimators: token-level rewards -> (advantages, returns).

Every estimator has one signature, so the trainer calls any of them the same way:

    fn(rewards, response_mask, index, values=None, **options) -> (advantages, returns)

`rewards` [N, R] are token-level rewards (a turn's reward on its last response
token), `response_mask` [N, R] is 1 on response tokens, `index` holds one group
id per row (the prompt uid; rows of one prompt form a group; None where the estimator does not group), `values` [N, R]
come from a critic. The trainer passes every algorithm option as a keyword;
each estimator uses the ones it names and ignores the rest. Both outputs are
[N, R] and zero where `response_mask` is 0. Outcome estimators (grpo, rloo)
give each row one scalar, broadcast over its response tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from skyrl.train.algorithms.reductions import masked_mean
from skyrl.train.algorithms.registry import Registry

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS = Registry("advantage estimator")


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: make `fn` available as `get_advantage_estimator(name)`."""
    return ADVANTAGE_ESTIMATORS.register(name)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """A built-in (`gae`, `grpo`, `rloo`, `reinforce++`), a registered name, or `"module:function"`.

    Raises `ValueError` listing the registered names when `name` is unknown.
    """
    return ADVANTAGE_ESTIMATORS.get(name)


def _check_index(index: Sequence | None, rewards: torch.Tensor, estimator: str | None = None) -> None:
    """`index` has one entry per row; None is accepted by estimators that do not group (`estimator` None)
    and refused, naming it, by those that do."""
    if index is None:
        if estimator is not None:
            raise ValueError(
                f"advantage estimator {estimator!r} groups rows by prompt: pass index (one id per row)"
            )
        return
    if len(index) != rewards.shape[0]:
        raise ValueError(
            f"index has {len(index)} entries but rewards has {rewards.shape[0]} rows; one per row"
        )


def _group_mean_and_size(scores: torch.Tensor, index: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the mean of `scores` over the row's group and the group's size."""
    group_of: dict = {}
    group = torch.tensor([group_of.setdefault(key, len(group_of)) for key in index], device=scores.device)
    size = torch.bincount(group, minlength=len(group_of)).to(scores.dtype)
    total = scores.new_zeros(len(group_of)).index_add_(0, group, scores)
    return (total / size)[group], size[group]


def _last_token(mask: torch.Tensor) -> torch.Tensor:
    """Per row: the position of the last nonzero mask entry."""
    return mask.shape[-1] - 1 - mask.flip(-1).argmax(-1)


def _gae_scan(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lambd: float
) -> torch.Tensor:
    """delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lambd A_{t+1}  (Schulman et al. 2016).

    t runs over the masked-in tokens of each row: a token with mask 0 is skipped
    (its reward and value are unused) and the chain links the tokens around it.
    """
    next_value = rewards.new_zeros(rewards.shape[0])
    next_advantage = rewards.new_zeros(rewards.shape[0])
    advantages = []
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lambd * next_advantage
        advantages.append(torch.where(m, advantage, 0.0))
        next_value = torch.where(m, values[:, t], next_value)
        next_advantage = torch.where(m, advantage, next_advantage)
    return torch.stack(advantages[::-1], dim=1)


@register_advantage_estimator("gae")
def gae(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | None,
    values: torch.Tensor | None = None,
    *,
    gamma: float = 1.0,
    lambd: float = 1.0,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016); returns = advantages + values.

    Needs critic `values`; `index` is unused. Advantages are not whitened.
    """
    _check_index(index, rewards)
    if values is None:
        raise ValueError("advantage estimator 'gae' needs critic values; enable the critic or pick 'grpo'")
    mask = response_mask.to(rewards.dtype)
    advantages = _gae_scan(rewards, values, mask, gamma, lambd)
    return advantages, (advantages + values) * mask


@register_advantage_estimator("grpo")
def grpo(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence,
    values: torch.Tensor | None = None,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage (GRPO, Shao et al. 2024): A = (score - mean_g) / (std_g + epsilon).

    score = sum of the row's token rewards; mean_g and std_g (unbiased) are over
    the rows sharing its `index`. With `norm_adv_by_std_in_grpo=False` only the
    mean is subtracted (Dr. GRPO, Liu et al. 2025). A group of one row gets 0.
    Returns equal the advantages.
    """
    _check_index(index, rewards, "grpo")
    scores = rewards.sum(-1)
    mean, size = _group_mean_and_size(scores, index)
    advantages = scores - mean
    if norm_adv_by_std_in_grpo:
        mean_square, _ = _group_mean_and_size(advantages**2, index)
        std = (mean_square * size / (size - 1).clamp(min=1)).sqrt()
        advantages = advantages / (std + epsilon)
    advantages = advantages[:, None] * response_mask.to(rewards.dtype)
    return advantages, advantages


@register_advantage_estimator("rloo")
def rloo(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence,
    values: torch.Tensor | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): A_i = score_i - mean_{j != i} score_j within the group.

    score = sum of the row's token rewards. A group of one row gets 0. Returns equal the advantages.
    """
    _check_index(index, rewards, "rloo")
    scores = rewards.sum(-1)
    mean, size = _group_mean_and_size(scores, index)
    baseline = (mean * size - scores) / (size - 1).clamp(min=1)
    advantages = torch.where(size > 1, scores - baseline, 0.0)
    advantages = advantages[:, None] * response_mask.to(rewards.dtype)
    return advantages, advantages


@register_advantage_estimator("reinforce++")
def reinforce_plus_plus(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | None,
    values: torch.Tensor | None = None,
    *,
    gamma: float = 1.0,
    group_baseline: bool = False,
    epsilon: float = 1e-8,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): returns-to-go G_t = sum_{k>=t} gamma^(k-t) r_k, whitened over the batch.

    Advantages = (G - mean) / (std + epsilon), mean and (biased) std over all
    response tokens of the batch. With `group_baseline` (REINFORCE++-baseline)
    each row's group-mean score is first subtracted from its last response
    token's reward. Returns are the un-whitened G.
    """
    _check_index(index, rewards, "reinforce++ with group_baseline" if group_baseline else None)
    mask = response_mask.to(rewards.dtype)
    if group_baseline:
        mean, _ = _group_mean_and_size(rewards.sum(-1), index)
        rewards = rewards - F.one_hot(_last_token(mask), rewards.shape[1]) * mean[:, None]
    returns = _gae_scan(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    centred = returns - masked_mean(returns, mask)
    advantages = centred / (masked_mean(centred**2, mask).sqrt() + epsilon) * mask
    return advantages, returns


def compute_stepwise_advantages(
    estimator: str | AdvantageEstimator,
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    uids: Sequence,
    trajectory_ids: Sequence,
    is_last_step: Sequence[bool],
    values: torch.Tensor | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages for step-wise rows (one row per LLM turn), one scalar per trajectory.

    The estimator runs on the last-step rows only, one row per trajectory, whose
    reward is the trajectory's total reward (the sum of all its rows' token
    rewards), placed on the last response token of the last step. The
    trajectory's advantage (and return) is the estimator's output at the first
    response token of that row; it is broadcast to every row of the trajectory
    and multiplied by each row's own `response_mask`. Rows may come in any
    order. Each trajectory needs exactly one last step, otherwise `ValueError`.
    """
    estimator = get_advantage_estimator(estimator) if isinstance(estimator, str) else estimator
    num_rows = rewards.shape[0]
    for name, column in (("uids", uids), ("trajectory_ids", trajectory_ids), ("is_last_step", is_last_step)):
        if len(column) != num_rows:
            raise ValueError(f"{name} has {len(column)} entries but rewards has {num_rows} rows")
    trajectory_of: dict = {}
    trajectory = torch.tensor(
        [trajectory_of.setdefault(t, len(trajectory_of)) for t in trajectory_ids], device=rewards.device
    )
    last_rows = [i for i, last in enumerate(is_last_step) if last]
    last_trajectories = [trajectory_ids[i] for i in last_rows]
    if len(set(last_trajectories)) != len(last_rows) or len(last_rows) != len(trajectory_of):
        missing = set(trajectory_of) - set(last_trajectories)
        raise ValueError(
            f"every trajectory needs exactly one row with is_last_step=True; "
            f"{len(last_rows)} last steps for {len(trajectory_of)} trajectories (without one: {sorted(map(str, missing))})"
        )
    last = torch.tensor(last_rows, device=rewards.device)
    mask = response_mask.to(rewards.dtype)
    last_mask = mask[last]
    total_reward = rewards.new_zeros(len(trajectory_of)).index_add_(0, trajectory, rewards.sum(-1))
    last_rewards = (
        F.one_hot(_last_token(last_mask), rewards.shape[1]) * total_reward[trajectory[last]][:, None]
    )
    last_values = values[last] if values is not None else None
    advantages, returns = estimator(
        last_rewards, last_mask, [uids[i] for i in last_rows], last_values, **options
    )

    # the trajectory's scalar: the estimator's output at the first response token of its last step
    first_token = last_mask.argmax(-1)
    rows = torch.arange(len(last_rows), device=rewards.device)

    def broadcast(per_last_row: torch.Tensor) -> torch.Tensor:
        scalar = rewards.new_zeros(len(trajectory_of)).index_copy(
            0, trajectory[last], per_last_row[rows, first_token]
        )
        return scalar[trajectory][:, None] * mask

    return broadcast(advantages), broadcast(returns)
