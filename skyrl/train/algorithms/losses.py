"""Policy losses, the value loss, KL penalties and entropy.

Policy losses share one signature, so the trainer calls any of them the same way:

    fn(log_probs, old_log_probs, advantages, loss_mask, *, eps_clip_low, eps_clip_high,
       clip_ratio_c, **options) -> (per_token_loss, metrics)

All tensors are [N, R]. `per_token_loss` is zero where `loss_mask` is 0 and is
not reduced: the worker multiplies it by the mini-batch's loss scale and sums
(see `reductions.py`). `metrics` are detached scalars over the masked-in tokens
of the given rows: `clip_frac`, `approx_kl` (k3 estimate of KL(old || new)),
`ratio_mean`, `ratio_max`, `ratio_min`. Options a loss does not use are ignored.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from skyrl.train.algorithms.reductions import masked_mean
from skyrl.train.algorithms.registry import Registry

Metrics = dict[str, torch.Tensor]
PolicyLoss = Callable[..., tuple[torch.Tensor, Metrics]]
POLICY_LOSSES = Registry("policy loss")


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: make `fn` available as `get_policy_loss(name)`."""
    return POLICY_LOSSES.register(name)


def get_policy_loss(name: str) -> PolicyLoss:
    """A built-in (`regular`, `dual_clip`, `gspo`, `cispo`), a registered name, or `"module:function"`.

    Raises `ValueError` listing the registered names when `name` is unknown.
    """
    return POLICY_LOSSES.get(name)


def _log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    # 0 off the mask: a placeholder old log-prob there must not overflow exp() or leak NaN into gradients
    return torch.where(loss_mask > 0, log_probs - old_log_probs, 0.0)


def _ratio_metrics(
    ratio: torch.Tensor, log_ratio: torch.Tensor, clipped: torch.Tensor, loss_mask: torch.Tensor
) -> Metrics:
    ratio, log_ratio = ratio.detach(), log_ratio.detach()
    masked_ratio = ratio[loss_mask > 0]
    if masked_ratio.numel() == 0:
        masked_ratio = ratio.new_ones(1)
    return {
        "clip_frac": masked_mean(clipped.to(ratio.dtype), loss_mask),
        "approx_kl": masked_mean(ratio - 1 - log_ratio, loss_mask),
        "ratio_mean": masked_mean(ratio, loss_mask),
        "ratio_max": masked_ratio.max(),
        "ratio_min": masked_ratio.min(),
    }


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_clip_low: float, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) and where the clipped term won."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_clip_low, 1 + eps_clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@register_policy_loss("regular")
def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    **options,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate (Schulman et al. 2017) with separate low / high clip ranges:

    L_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_clip_low, 1 + eps_clip_high)),  r_t = pi(y_t) / pi_old(y_t).
    """
    log_ratio = _log_ratio(log_probs, old_log_probs, loss_mask)
    ratio = log_ratio.exp()
    loss, clipped = _clipped_surrogate(ratio, advantages, eps_clip_low, eps_clip_high)
    return loss * loss_mask, _ratio_metrics(ratio, log_ratio, clipped, loss_mask)


@register_policy_loss("dual_clip")
def dual_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    **options,
) -> tuple[torch.Tensor, Metrics]:
    """Dual-clip PPO (Ye et al. 2020): the `regular` loss, and for A_t < 0 at most -A_t * clip_ratio_c.

    Bounds the loss of a negative-advantage token whose ratio has exploded.
    Adds the metric `dual_clip_frac`. `clip_ratio_c` must exceed 1.
    """
    if clip_ratio_c <= 1:
        raise ValueError(
            f"dual_clip needs clip_ratio_c > 1, got clip_ratio_c={clip_ratio_c}; the paper uses 3"
        )
    loss, metrics = ppo_clip_loss(
        log_probs,
        old_log_probs,
        advantages,
        loss_mask,
        eps_clip_low=eps_clip_low,
        eps_clip_high=eps_clip_high,
    )
    cap = -advantages * clip_ratio_c
    capped = (advantages < 0) & (cap < loss)
    metrics["dual_clip_frac"] = masked_mean(capped.to(loss.dtype), loss_mask)
    return torch.where(capped, cap, loss) * loss_mask, metrics


@register_policy_loss("gspo")
def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip_low: float = 3e-4,
    eps_clip_high: float = 4e-4,
    **options,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025), token-level form: the clipped surrogate with r_t replaced by

    s_t = sg[s] * pi(y_t) / sg[pi(y_t)],  s = exp(mean_t log(pi(y_t) / pi_old(y_t))) over the sequence.

    s_t equals the sequence ratio s in value, so a whole sequence clips
    together; its gradient is s * grad log pi(y_t). The paper uses the clip
    ranges 3e-4 / 4e-4 and the `sequence_mean` reduction.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs, loss_mask)
    sequence_log_ratio = masked_mean(log_ratio, loss_mask, dim=-1)
    ratio = (sequence_log_ratio.detach()[:, None] + log_ratio - log_ratio.detach()).exp()
    loss, clipped = _clipped_surrogate(ratio, advantages, eps_clip_low, eps_clip_high)
    return loss * loss_mask, _ratio_metrics(ratio, log_ratio, clipped, loss_mask)


@register_policy_loss("cispo")
def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    **options,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1, 2025): L_t = -sg[clip(r_t, 1 - eps_clip_low, 1 + eps_clip_high)] * A_t * log pi(y_t).

    The importance weight is clipped and detached, so every token keeps a
    gradient. MiniMax-M1 sets no lower bound: pass eps_clip_low >= 1.
    """
    log_ratio = _log_ratio(log_probs, old_log_probs, loss_mask)
    ratio = log_ratio.exp()
    weight = ratio.clamp(1 - eps_clip_low, 1 + eps_clip_high).detach()
    loss = -weight * advantages * log_probs * loss_mask
    return loss, _ratio_metrics(ratio, log_ratio, weight != ratio, loss_mask)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    value_clip: float | None = 0.2,
) -> tuple[torch.Tensor, Metrics]:
    """PPO value loss, per token: 0.5 * max((V - G)^2, (V_clip - G)^2).

    V_clip = V_old + clip(V - V_old, -value_clip, value_clip); `value_clip=None`
    gives 0.5 * (V - G)^2. Zero where `loss_mask` is 0; reduce it like the
    policy loss. Metric: `vf_clip_frac`.
    """
    loss = (values - returns) ** 2
    clipped = torch.zeros_like(loss, dtype=torch.bool)
    if value_clip is not None:
        clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped_loss = (clipped_values - returns) ** 2
        clipped = clipped_loss > loss
        loss = torch.maximum(loss, clipped_loss)
    return 0.5 * loss * loss_mask, {"vf_clip_frac": masked_mean(clipped.to(loss.dtype), loss_mask).detach()}


OFF_POLICY_CORRECTIONS = ("none", "tis", "mis", "seq_tis", "seq_mis")


def off_policy_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    tis_cap: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
    """Importance weights for tokens sampled by the engines (`rollout_log_probs`) but trained as the
    trainer's policy (`old_log_probs`): returns (weights, loss_mask, metrics), all [N, R] but metrics.

    The ratio is rho_t = pi_old(y_t) / pi_rollout(y_t), per token, or for the `seq_*` modes the
    product over the row's loss tokens. `tis` (truncated IS): weight min(rho, tis_cap). `mis`
    (masked IS, icepop-style): tokens (`seq_mis`: whole rows) with rho outside [mis_low, mis_high]
    leave the loss mask, weight 1. `none`: weight 1, mask unchanged. Metrics: `is_weight_mean` over
    the kept loss tokens, `is_masked_fraction` of the loss tokens. Nothing here has a gradient.
    """
    if mode not in OFF_POLICY_CORRECTIONS:
        raise ValueError(
            f"unknown off-policy correction {mode!r}; choose one of {list(OFF_POLICY_CORRECTIONS)}"
        )
    on = loss_mask > 0
    log_rho = torch.where(on, old_log_probs - rollout_log_probs, 0.0).detach()
    if mode.startswith("seq_"):
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    rho = log_rho.clamp(max=50.0).exp()
    weights, mask = torch.ones_like(rho), loss_mask
    if mode.endswith("tis"):
        weights = rho.clamp(max=tis_cap)
    elif mode.endswith("mis"):
        mask = loss_mask * ((rho >= mis_low) & (rho <= mis_high)).to(loss_mask.dtype)
    metrics = {
        "is_weight_mean": masked_mean(weights, mask),
        "is_masked_fraction": (loss_mask.sum() - mask.sum()) / loss_mask.sum().clamp(min=1),
    }
    return weights * (mask > 0), mask, metrics


def rollout_logprob_gap(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Mean |rollout - old| logprob over the loss tokens: the engines' and the trainer's logprobs of the
    same tokens (`policy/rollout_logprob_gap`; large means stale engine weights or a mismatch)."""
    return masked_mean((rollout_log_probs - old_log_probs).abs(), loss_mask)


KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k3", k3_bound: float = 10.0
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi (Schulman, "Approximating KL divergence").

    With log r = log pi_ref(y_t) - log pi(y_t):
    k1 = -log r (unbiased, can be negative), k2 = (log r)^2 / 2 (biased, low
    variance), k3 = (r - 1) - log r (unbiased, >= 0), clamped to [-k3_bound, k3_bound].
    Use it as a loss term (reduce it like the policy loss) or as a reward
    penalty (`apply_kl_penalty_to_rewards`). Unknown `kind` raises `ValueError`.
    """
    log_r = ref_log_probs - log_probs
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        # bound log r first: exp() overflowing to inf would make the clamped gradient NaN
        log_r = log_r.clamp(-20.0, 20.0)
        return (log_r.exp() - 1 - log_r).clamp(-k3_bound, k3_bound)
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {list(KL_ESTIMATORS)}")


def apply_kl_penalty_to_rewards(
    rewards: torch.Tensor, kl: torch.Tensor, kl_coef: float, response_mask: torch.Tensor
) -> torch.Tensor:
    """r_t - kl_coef * KL_t on response tokens (Ziegler et al. 2019); a new tensor."""
    return rewards - kl_coef * kl * response_mask


class FixedKLController:
    """A constant KL coefficient `value`."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Constant: nothing to update."""


class AdaptiveKLController:
    """KL coefficient steered towards `target_kl` (Ziegler et al. 2019, section 2.2):

    e = clip(KL / target_kl - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl} and {horizon}"
            )
        self.value = init_kl_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Grow the coefficient when KL is above target, shrink it when below; `n_steps` samples were seen."""
        error = min(max(current_kl / self.target_kl - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def entropy_from_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """Entropy of a distribution given as log-probabilities over the last dimension: H = -sum_i p_i log p_i
    (a masked-out token, log p = -1e9, adds 0)."""
    return -(logprobs.exp() * logprobs).sum(-1)
