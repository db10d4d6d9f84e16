"""User-defined algorithms, referenced by the registry tests as "module:function" strings."""

from skyrl.train.algorithms import grpo, register_advantage_estimator


def constant_advantage(rewards, response_mask, index, values=None, *, constant=2.0, **options):
    advantages = constant * response_mask.to(rewards.dtype)
    return advantages, advantages


def linear_policy_loss(log_probs, old_log_probs, advantages, loss_mask, **options):
    """Vanilla policy gradient: L_t = -A_t log pi(y_t)."""
    return -advantages * log_probs * loss_mask, {"mean_log_prob": (log_probs * loss_mask).sum().detach()}


@register_advantage_estimator("user_negated_grpo")
def negated_grpo(rewards, response_mask, index, values=None, **options):
    advantages, returns = grpo(rewards, response_mask, index, values, **options)
    return -advantages, -returns
