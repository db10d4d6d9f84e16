import dataclasses

import pytest

from skyrl.train.config import BatchSizes, ConfigError, validate_batch_sizes

GOOD = BatchSizes(
    train_batch_size=16,
    policy_mini_batch_size=4,
    micro_train_batch_size_per_gpu=2,
    micro_forward_batch_size_per_gpu=4,
    n_samples_per_prompt=4,
    policy_dp_size=2,
    critic_mini_batch_size=8,
    critic_dp_size=4,
)


def with_(**changes) -> BatchSizes:
    return dataclasses.replace(GOOD, **changes)


def test_valid_settings_pass():
    validate_batch_sizes(GOOD)
    validate_batch_sizes(with_(critic_mini_batch_size=None, critic_dp_size=0))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"train_batch_size": 0}, r"trainer.train_batch_size=0 must be a positive integer"),
        ({"n_samples_per_prompt": -1}, r"generator.n_samples_per_prompt=-1 must be a positive"),
        ({"micro_forward_batch_size_per_gpu": 0}, r"micro_forward_batch_size_per_gpu=0 must be"),
        ({"policy_dp_size": 0}, r"policy data-parallel size .*=0 must be"),
        ({"critic_dp_size": 0}, r"critic data-parallel size .*=0 must be"),
        (
            {"policy_mini_batch_size": 32},
            r"policy_mini_batch_size=32 is larger than trainer.train_batch_size=16",
        ),
        (
            {"policy_mini_batch_size": 3},
            r"train_batch_size=16 is not divisible by trainer.policy_mini_batch_size=3.*policy_mini_batch_size=2\b",
        ),
        (
            {"critic_mini_batch_size": 6},
            r"not divisible by trainer.critic_mini_batch_size=6.*critic_mini_batch_size=4\b",
        ),
        (
            {"n_samples_per_prompt": 1, "policy_mini_batch_size": 1, "policy_dp_size": 2},
            r"= 1 sequences per mini-batch is fewer than the policy data-parallel size",
        ),
        (
            {"n_samples_per_prompt": 3, "policy_dp_size": 8},
            r"12 sequences per mini-batch cannot be split evenly .*policy_mini_batch_size=8\b",
        ),
        (
            {"micro_train_batch_size_per_gpu": 3},
            r"rank gets 8 sequences .* not divisible by trainer.micro_train_batch_size_per_gpu=3.*=2\b",
        ),
        ({"policy_mini_batch_size": True}, r"policy_mini_batch_size=True must be a positive integer"),
    ],
)
def test_each_bad_setting_gets_one_readable_error(changes, message):
    with pytest.raises(ConfigError, match=message):
        validate_batch_sizes(with_(**changes))


def test_step_wise_relaxes_per_rank_divisibility():
    relaxed = with_(
        n_samples_per_prompt=3, policy_dp_size=8, micro_train_batch_size_per_gpu=5, step_wise=True
    )
    validate_batch_sizes(relaxed)
    with pytest.raises(ConfigError, match="cannot be split evenly"):
        validate_batch_sizes(dataclasses.replace(relaxed, step_wise=False))


def test_step_wise_still_needs_prompt_divisibility():
    with pytest.raises(ConfigError, match=r"not divisible by trainer\.policy_mini_batch_size=5"):
        validate_batch_sizes(with_(policy_mini_batch_size=5, step_wise=True))
