"""Configuration rules checked before anything starts.

`validate_batch_sizes` holds every rule between batch sizes, sample counts and
data-parallel sizes. Each failure is one `ConfigError` naming the config keys,
their values and a valid nearby setting.
"""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A configuration the user can fix; the message names the key, the value and a fix."""


@dataclass(frozen=True)
class BatchSizes:
    """The batch-size settings of a run, named as in the config tree.

    Units: `train_batch_size` and the mini-batch sizes count prompts; micro-batch
    sizes count sequences per data-parallel rank. `critic_mini_batch_size=None`
    means the run has no critic.
    """

    train_batch_size: int
    policy_mini_batch_size: int
    micro_train_batch_size_per_gpu: int
    micro_forward_batch_size_per_gpu: int
    n_samples_per_prompt: int
    policy_dp_size: int
    step_wise: bool = False
    critic_mini_batch_size: int | None = None
    critic_dp_size: int = 1


KEYS = {
    "train_batch_size": "trainer.train_batch_size",
    "policy_mini_batch_size": "trainer.policy_mini_batch_size",
    "critic_mini_batch_size": "trainer.critic_mini_batch_size",
    "micro_train_batch_size_per_gpu": "trainer.micro_train_batch_size_per_gpu",
    "micro_forward_batch_size_per_gpu": "trainer.micro_forward_batch_size_per_gpu",
    "n_samples_per_prompt": "generator.n_samples_per_prompt",
    "policy_dp_size": "policy data-parallel size (trainer.placement.policy_num_nodes * policy_num_gpus_per_node)",
    "critic_dp_size": "critic data-parallel size (trainer.placement.critic_num_nodes * critic_num_gpus_per_node)",
}


def _nearest(target: int, candidates: list[int]) -> int | None:
    return min(candidates, key=lambda c: (abs(c - target), c)) if candidates else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_model(cfg: BatchSizes, role: str, mini: int, dp: int) -> None:
    mini_key, dp_key = KEYS[f"{role}_mini_batch_size"], KEYS[f"{role}_dp_size"]
    train, n = cfg.train_batch_size, cfg.n_samples_per_prompt
    if mini > train:
        raise ConfigError(
            f"{mini_key}={mini} is larger than {KEYS['train_batch_size']}={train}; "
            f"a mini-batch is a part of the training batch, e.g. {mini_key}={train}."
        )
    if train % mini != 0:
        raise ConfigError(
            f"{KEYS['train_batch_size']}={train} is not divisible by {mini_key}={mini} (both count prompts, "
            f"so every mini-batch holds the same prompts); use e.g. {mini_key}={_nearest(mini, _divisors(train))}."
        )
    if mini * n < dp:
        raise ConfigError(
            f"{mini_key}={mini} prompts x {KEYS['n_samples_per_prompt']}={n} samples = {mini * n} sequences "
            f"per mini-batch is fewer than the {dp_key}={dp}, so some ranks would train on padding only; "
            f"raise {mini_key} or {KEYS['n_samples_per_prompt']}, or use fewer ranks."
        )
    if cfg.step_wise:
        return  # sequences per mini-batch vary with turns: padding and ragged micro-batches absorb it
    if (mini * n) % dp != 0:
        valid = [m for m in _divisors(train) if (m * n) % dp == 0]
        fix = (
            f"e.g. {mini_key}={_nearest(mini, valid)}" if valid else f"change {KEYS['n_samples_per_prompt']}"
        )
        raise ConfigError(
            f"{mini_key}={mini} x {KEYS['n_samples_per_prompt']}={n} = {mini * n} sequences per mini-batch "
            f"cannot be split evenly over the {dp_key}={dp}; {fix}."
        )
    per_rank, micro = mini * n // dp, cfg.micro_train_batch_size_per_gpu
    if per_rank % micro != 0:
        raise ConfigError(
            f"each {role} rank gets {per_rank} sequences per mini-batch ({mini_key}={mini} x "
            f"{KEYS['n_samples_per_prompt']}={n} / {dp} ranks), not divisible by "
            f"{KEYS['micro_train_batch_size_per_gpu']}={micro}; use e.g. "
            f"{KEYS['micro_train_batch_size_per_gpu']}={_nearest(micro, _divisors(per_rank))} "
            "(or generator.step_wise=true, where the last micro-batch may be smaller)."
        )


def validate_batch_sizes(cfg: BatchSizes) -> None:
    """Raise `ConfigError` for the first batch-size rule `cfg` breaks.

    Rules: every size is positive; mini-batch sizes divide `train_batch_size`
    and are not larger than it; a mini-batch has at least one sequence per DP
    rank; outside step-wise training a mini-batch's sequences split evenly over
    the DP ranks and each rank's share splits evenly into micro-batches. Step-wise
    training relaxes the last two, since sequence counts depend on turns.
    """
    positive = [
        "train_batch_size",
        "policy_mini_batch_size",
        "micro_train_batch_size_per_gpu",
        "micro_forward_batch_size_per_gpu",
        "n_samples_per_prompt",
        "policy_dp_size",
    ]
    if cfg.critic_mini_batch_size is not None:
        positive += ["critic_mini_batch_size", "critic_dp_size"]
    for name in positive:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{KEYS[name]}={value!r} must be a positive integer, e.g. {KEYS[name]}=1.")
    _check_model(cfg, "policy", cfg.policy_mini_batch_size, cfg.policy_dp_size)
    if cfg.critic_mini_batch_size is not None:
        _check_model(cfg, "critic", cfg.critic_mini_batch_size, cfg.critic_dp_size)
