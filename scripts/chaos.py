"""Chaos run: the default job while engine and worker actors are killed at random times.

Runs the default job (the tiny model on `guess_number`, colocated, local Ray) twice in one Ray
cluster: undisturbed, then while a thread kills `--kills` random actors (an inference engine or a
policy / ref / critic rank, chosen and timed by `--seed`, at times spread over the undisturbed run's
training time). Then it checks that the chaos run reached `total_steps`, that `metrics.jsonl` holds
each step once, that the policy made exactly the optimizer steps of `total_steps` steps (a step
rolled back by a worker restart and trained again counts once), and that its last checkpoint loads
into a new trainer at the final step with the weights of the final export.

Prints each kill, `kills survived K / N` and `overhead X` (chaos wall time over undisturbed wall
time, both from the first step to the end). Exits non-zero when a check fails.

Usage: python scripts/chaos.py [--kills 4] [--seed 0] [--steps 40] [--ckpt-interval 5] [key=value ...]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from skyrl.train.config import compose_config
from skyrl.train.trainer import Trainer, load_datasets, resolve_model_path
from skyrl.train.utils.tracking import read_metrics


class TimedTrainer(Trainer):
    """Records when its first step starts (start-up excluded from the timings)."""

    first_step_at: float | None = None

    def train_step(self) -> dict[str, float]:
        self.first_step_at = self.first_step_at or time.perf_counter()
        return super().train_step()


def build(overrides: list[str], run_dir: Path) -> TimedTrainer:
    cfg = compose_config(overrides)
    model = resolve_model_path(cfg.trainer.policy.model.path)
    return TimedTrainer(cfg, run_dir, model, load_datasets(cfg, AutoTokenizer.from_pretrained(model)))


def victims(trainer: Trainer) -> list[tuple[str, Any]]:
    """Every actor a kill may hit now: (name, handle)."""
    actors = [(f"engine {i}", engine) for i, engine in enumerate(trainer.client.engines)]
    for group in (trainer.policy, trainer.ref, trainer.critic):
        if group is not None:
            actors += [(f"{group.role} rank {r}", a) for r, a in enumerate(group.actors)]
    return actors


def kill_at(trainer: TimedTrainer, offsets: list[float], rng: random.Random, kills: list[str]) -> None:
    """From the first step on, kill a random actor `offsets[i]` seconds in; stops with the run."""
    while trainer.first_step_at is None:
        time.sleep(0.05)
    for offset in offsets:
        while time.perf_counter() < trainer.first_step_at + offset:
            if trainer.step >= trainer.cfg.trainer.total_steps:
                return
            time.sleep(0.05)
        name, actor = rng.choice(victims(trainer))
        ray.kill(actor)
        kills.append(f"{time.perf_counter() - trainer.first_step_at:6.1f} s, step {trainer.step + 1}: {name}")
        print(f"chaos: killed {kills[-1]}", flush=True)


def timed_fit(trainer: TimedTrainer) -> tuple[list[dict[str, float]], float]:
    try:
        history = trainer.fit()
        return history, time.perf_counter() - (trainer.first_step_at or time.perf_counter())
    finally:
        trainer.shutdown()


def checks(run_dir: Path, overrides: list[str], steps: int) -> list[str]:
    """What is wrong with the finished chaos run in `run_dir` (empty: nothing)."""
    problems = []
    logged = [int(r["step"]) for r in read_metrics(run_dir)]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    if logged != list(range(1, steps + 1)) or len(lines) != steps:
        problems.append(
            f"metrics.jsonl holds steps {logged} in {len(lines)} records, not 1..{steps} once each"
        )
    trainer = build(overrides, run_dir)  # resume_mode=latest
    try:
        resumed = trainer.resume()
        t = trainer.cfg.trainer
        per_step = t.train_batch_size // t.policy_mini_batch_size * t.update_epochs_per_batch
        optimizer_steps = trainer.policy.actors[0].__ray_call__.remote(lambda w: w.global_step)
        if (made := ray.get(optimizer_steps)) != steps * per_step:
            problems.append(
                f"the policy made {made} optimizer steps, not {steps * per_step}: a step trained twice"
            )
        if resumed is None or trainer.step != steps:
            problems.append(f"the last checkpoint ({resumed}) resumes at step {trainer.step}, not {steps}")
        state = trainer.policy.full_state_dict()
        export = AutoModelForCausalLM.from_pretrained(run_dir / "hf_model" / f"global_step_{steps}")
        for name, tensor in export.state_dict().items():
            if not torch.equal(tensor, state[name]):
                problems.append(f"checkpoint weight {name} differs from the final export")
                break
    finally:
        trainer.shutdown()
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ckpt-interval", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value) for both runs")
    args = parser.parse_args()
    overrides = [
        f"trainer.total_steps={args.steps}",
        f"trainer.ckpt_interval={args.ckpt_interval}",
        "trainer.logger=[jsonl]",
        f"trainer.max_restarts={args.kills}",
        f"generator.max_engine_restarts={args.kills}",
        *args.overrides,
    ]
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
    with tempfile.TemporaryDirectory() as tmp:
        _, baseline = timed_fit(build(overrides, Path(tmp) / "undisturbed"))
        print(f"undisturbed: {args.steps} steps in {baseline:.1f} s", flush=True)
        rng = random.Random(args.seed)
        offsets = sorted(rng.uniform(0.05, 0.95) * baseline for _ in range(args.kills))
        run_dir = Path(tmp) / "chaos"
        trainer = build(overrides, run_dir)
        kills: list[str] = []
        killer = threading.Thread(target=kill_at, args=(trainer, offsets, rng, kills), daemon=True)
        killer.start()
        try:
            history, seconds = timed_fit(trainer)
        except Exception as error:
            print(f"the run failed after {len(kills)} kill(s): {error!r}")
            sys.exit(1)
        killer.join(timeout=1)
        print(f"chaos: {len(history)} steps in this process, {args.steps} in all, in {seconds:.1f} s")
        problems = checks(run_dir, overrides, args.steps)
    for problem in problems:
        print(f"check failed: {problem}")
    print(f"kills survived {len(kills)} / {len(kills)}")
    print(f"overhead {seconds / baseline:.2f}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
