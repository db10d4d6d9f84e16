import dataclasses

import pytest

from skyrl.train.config import (
    BatchSizes,
    ConfigError,
    check_gpu_budget,
    compose_config,
    preflight,
    validate_batch_sizes,
)

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


LAYOUT = [
    "placement=disaggregated",
    "trainer.placement.policy_num_gpus_per_node=4",
    "generator.inference_engine.num_engines=2",
    "generator.inference_engine.tensor_parallel_size=2",
]


def test_a_layout_that_needs_more_gpus_than_the_cluster_has_is_refused_naming_each_part():
    cfg = compose_config(LAYOUT)
    check_gpu_budget(cfg, use_ref=False, use_critic=False, cluster_gpus=8)
    with pytest.raises(ConfigError, match=r"needs 9 GPUs \(policy .* 4, ref .* 1, engines .* 4\), .* has 8"):
        check_gpu_budget(cfg, use_ref=True, use_critic=False, cluster_gpus=8)
    colocated = compose_config(
        ["trainer.placement.policy_num_gpus_per_node=4", "trainer.algorithm.use_kl_loss=true"]
    )
    check_gpu_budget(colocated, use_ref=True, use_critic=False, cluster_gpus=4)  # all share the 4 bundles
    with pytest.raises(ConfigError, match=r"needs 9 GPUs"):  # preflight asks the same of the cluster
        preflight(compose_config([*LAYOUT, "trainer.algorithm.use_kl_loss=true"]), {"CPU": 64.0, "GPU": 8.0})
    preflight(compose_config(LAYOUT), {"CPU": 8.0})  # no GPUs: the engines and workers run on CPUs
    judged = compose_config(
        [*LAYOUT, "+reward.sources.judge={type: judge, model: tiny, engine: {num_engines: 2}}"]
    )
    with pytest.raises(ConfigError, match=r"needs 10 GPUs \(.*engines .* 4, judge judge engines 2\)"):
        check_gpu_budget(judged, use_ref=False, use_critic=False, cluster_gpus=8)


def test_preflight_refuses_a_sequence_parallel_size_that_does_not_divide_the_attention_heads():
    from types import SimpleNamespace

    sp3 = compose_config(
        ["trainer.placement.policy_num_gpus_per_node=3", "trainer.policy.sequence_parallel_size=3"]
    )
    preflight(sp3, {"CPU": 8.0}, 0, SimpleNamespace(num_attention_heads=6, num_key_value_heads=2))
    with pytest.raises(
        ConfigError,
        match=r"trainer.policy.sequence_parallel_size=3 does not divide the model's 4 attention heads "
        r"\(2 key/value heads\).* use one of \[1, 2, 4\]",
    ):
        preflight(sp3, {"CPU": 8.0}, 0, SimpleNamespace(num_attention_heads=4, num_key_value_heads=2))
    rm = compose_config(  # the tiny model, as the reward model, has 2 heads
        [
            "trainer.placement.policy_num_gpus_per_node=3",
            "+reward.sources.rm={type: model, model: tiny, sequence_parallel_size: 3}",
        ]
    )
    with pytest.raises(
        ConfigError,
        match=r"reward.sources.rm.sequence_parallel_size=3 does not divide the model's 2 attention heads",
    ):
        preflight(rm, {"CPU": 8.0}, 0, SimpleNamespace(num_attention_heads=6, num_key_value_heads=2))


def test_preflight_refuses_broadcast_between_colocated_gpu_ranks_and_flash_attention_without_its_gpu():
    broadcast = compose_config(["generator.inference_engine.weight_sync=broadcast"])
    preflight(broadcast, {"CPU": 8.0})  # gloo on CPU: the ranks may share a node
    with pytest.raises(ConfigError, match=r"weight_sync=broadcast needs engines on GPUs of their own"):
        preflight(broadcast, {"CPU": 8.0, "GPU": 1.0})
    flash = compose_config(["trainer.policy.model.attn_implementation=flash_attention_2"])
    with pytest.raises(
        ConfigError, match=r"trainer.policy.model.attn_implementation=flash_attention_2 needs a GPU.* 0 GPUs"
    ):
        preflight(flash, {"CPU": 8.0})
