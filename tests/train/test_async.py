"""Asynchronous training (`trainer.async_training.max_staleness` >= 1) through the whole loop:
the same data path as the synchronous loop, the staleness bound from the recorded versions, the
generator running ahead, learning, and resume mid-run."""

import json
import shutil

import pytest
from transformers import AutoTokenizer

from skyrl.train.config import compose_config
from skyrl.train.generator.stream import episode_staleness
from skyrl.train.sampler import load_datasets
from skyrl.train.trainer import Trainer
from skyrl.train.utils.tracking import read_metrics
from tests.metrics_reference import assert_documented
from tests.train.test_trainer import SMALL, assert_learns, killed_while_saving, learning

ASYNC = [*SMALL, "placement=disaggregated"]


def build(overrides, run_dir, model_path):
    """A trainer whose `generate` records, per step, the policy version it trains at and the episodes."""
    cfg = compose_config(overrides)
    trainer = Trainer(
        cfg, run_dir, str(model_path), load_datasets(cfg, AutoTokenizer.from_pretrained(model_path))
    )
    trainer.recorded = []
    generate = trainer.sampler.generate

    def recording(*args):
        episodes, excluded, metrics = generate(*args)
        trainer.recorded.append((trainer.weight_version, episodes))
        return episodes, excluded, metrics

    trainer.sampler.generate = recording
    return trainer


def run(overrides, run_dir, model_path):
    """`fit` with `overrides`; the metrics and the recorded (policy version, episodes) of each step."""
    trainer = build(overrides, run_dir, model_path)
    try:
        history = trainer.fit()
    finally:
        trainer.shutdown()
    assert_documented(history)
    return history, trainer.recorded


def prompts(episodes):
    """Each episode's prompt (its first context), in batch order."""
    return [tuple(e.trajectory.turns[0].context_ids) for e in episodes]


# Greedy rollouts and a learning rate too small to move a weight, shaped rewards whitened over the batch
# (the advantages of identical samples get a gradient), checkpoints every 2 steps: the runs of the
# data-path and resume tests.
STILL = [
    *ASYNC,
    "generator.sampling.temperature=0",
    "trainer.policy.optimizer.lr=1e-30",
    "algorithm=reinforce_pp",
    "environment.config.guess_number.shaped=true",
    "trainer.ckpt_interval=2",
    "trainer.total_steps=4",
]
AHEAD = [*STILL, "trainer.async_training.max_staleness=1"]


@pytest.fixture(scope="module")
def ahead_run(ray_cluster, tiny_model_path, tmp_path_factory):
    """`AHEAD` for 4 steps, uninterrupted: the asynchronous run of the data-path test and the straight
    run of the resume test, whose killed run is a copy of it (one trainer start for both). Its metrics,
    recorded steps and run directory."""
    run_dir = tmp_path_factory.mktemp("ahead")
    return *run(AHEAD, run_dir, tiny_model_path), run_dir


def test_async_data_path_reproduces_the_synchronous_run_while_the_weights_stand_still(
    ahead_run, tiny_model_path, tmp_path
):
    """While the weights stand still, generating ahead samples what the synchronous loop samples: any
    difference is the asynchronous data path's (draw order, grouping, batches, metrics)."""
    sync, sync_steps = run(STILL, tmp_path / "sync", tiny_model_path)
    ahead, ahead_steps, _ = ahead_run
    assert [m["async/staleness_max"] for m in ahead] == [0, 1, 1, 1]
    assert "async/staleness_max" not in sync[0]
    for (_, a), (_, b) in zip(sync_steps, ahead_steps, strict=True):
        assert prompts(a) == prompts(b)
        assert [t.response_ids for e in a for t in e.trajectory.turns] == [
            t.response_ids for e in b for t in e.trajectory.turns
        ]
    for a, b in zip(sync, ahead, strict=True):
        assert a["policy/grad_norm"] > 0
        for key in (
            "reward/mean",
            "episode/turns",
            "batch/sequences",
            "policy/loss",
            "policy/grad_norm",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key


@pytest.mark.parametrize(("staleness", "inflight"), [(2, False), (1, True)])
def test_the_generator_runs_ahead_within_the_staleness_bound(
    ray_cluster, tiny_model_path, tmp_path, staleness, inflight
):
    """Without in-flight updates a sync waits for the episodes in progress; with them it lands in
    them, and the bound holds for each episode's oldest turn either way (staleness 1 without in-flight
    updates is the learning test's and the data-path test's)."""
    overrides = [
        *ASYNC,
        f"trainer.async_training.max_staleness={staleness}",
        f"generator.inflight_weight_updates={str(inflight).lower()}",
        "trainer.total_steps=8",
    ]
    trainer = build(overrides, tmp_path, tiny_model_path)
    try:
        history = [trainer.train_step() for _ in range(4)]
        # the generator ran ahead: each later step's episodes began before the previous step's
        # training ended, and were generated exactly `staleness` versions back once it could be
        assert all(m["async/started_ahead_s"] > 0 for m in history[1:]), history
        assert [m["async/staleness_max"] for m in history] == [min(k, staleness) for k in range(4)]
        # the policy moves on without the stream: what it generated ahead is now too old
        for _ in range(staleness + 1):
            trainer.sync_weights()
        history.append(trainer.train_step())
        assert history[-1]["async/dropped_episodes"] == 16  # 4 prompts x 4 samples, generated again
        for version, episodes in trainer.recorded:
            for episode in episodes:
                assert 0 <= episode_staleness(episode, version) <= staleness
    finally:
        trainer.shutdown()


def test_grpo_learns_guess_number_one_step_off_policy(
    ray_cluster, learning_model_path, tmp_path, learning_seed
):
    """The fast-learning task (`FAST`) generating one step ahead, with truncated importance sampling
    (the default task's large steps move the policy ~0.2 nats per token per step; uncorrected, 1 of 6
    runs of the default task measured stayed at random guessing for 70 steps)."""
    overrides = [
        *learning(learning_model_path, learning_seed, fast=True),
        "placement=disaggregated",
        "trainer.async_training.max_staleness=1",
        "trainer.algorithm.off_policy_correction=tis",
    ]
    history, _ = run(overrides, tmp_path, learning_model_path)
    assert_learns(history)
    assert max(m["async/staleness_max"] for m in history) == 1


def test_resume_mid_run_with_async_continues_the_same_run(ahead_run, tiny_model_path, tmp_path):
    """The straight run as if killed in its step 4 before that step's checkpoint completed: resumed from
    step 2's (saved while the stream had drawn ahead), it takes the straight run's prompts."""
    _, straight_steps, straight_dir = ahead_run
    shutil.copytree(straight_dir, tmp_path / "killed")
    killed_while_saving(tmp_path / "killed" / "checkpoints" / "global_step_4")
    # the checkpoint holds the prompts the trained steps took, not those the stream drew ahead
    state = json.loads(
        (tmp_path / "killed" / "checkpoints" / "global_step_2" / "trainer_state.json").read_text()
    )
    assert state["loader"] == {"epoch": 0, "position": 8}  # 2 steps x 4 prompts
    resumed, resumed_steps = run(AHEAD, tmp_path / "killed", tiny_model_path)
    assert len(resumed) == 2
    for (_, a), (version, b) in zip(straight_steps[2:], resumed_steps, strict=True):
        assert prompts(a) == prompts(b)
        assert all(episode_staleness(e, version) <= 1 for e in b)
    assert [r["step"] for r in read_metrics(tmp_path / "killed")] == [1, 2, 3, 4]
    assert all(m["policy/grad_norm"] > 0 for m in resumed)
