"""Chaos run: the default job while faults hit it at random times.

Runs the default job (the tiny model on `guess_number`, colocated, local Ray) twice in one Ray
cluster: undisturbed, then while a thread injects `--kills` faults, each of a kind drawn from
`--faults` and timed by `--seed` over the undisturbed run's training time:
- `kill`: a random actor dies (an inference engine or a policy / ref / critic rank);
- `sigterm`: the driver gets SIGTERM, as from a scheduler's pre-emption: the run stops at the step
  boundary with a checkpoint (or abandons the step after `trainer.preemption_grace_s`), and the script
  resumes it in the same run directory, as a requeued job would;
- `hang`: the next environment step never returns (its episode fails at `environment.timeout_s`,
  which the script sets to 5 s; the stuck thread is abandoned).
Then it checks that the chaos run reached `total_steps`, that `metrics.jsonl` holds
each step once, that the policy made exactly the optimizer steps of `total_steps` steps (a step
rolled back by a worker restart and trained again counts once), and that its last checkpoint loads
into a new trainer at the final step with the weights of the final export. The script's own exit
(with hung env threads left behind) is the check that they do not hold the process.

Prints each fault, `faults survived K / N` and `overhead X` (chaos wall time over undisturbed wall
time, both from the first step to the end, resumes included). Exits non-zero when a check fails.

Usage: python scripts/chaos.py [--kills 4] [--faults kill,sigterm,hang] [--seed 0] [--steps 40]
       [--ckpt-interval 5] [key=value ...]
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from skyrl.envs.guess_number import GuessNumberEnv
from skyrl.train.cluster import resolve_model_path
from skyrl.train.config import compose_config
from skyrl.train.sampler import load_datasets
from skyrl.train.trainer import Trainer
from skyrl.train.utils.preemption import Preempted
from skyrl.train.utils.tracking import read_metrics

FAULTS = ("kill", "sigterm", "hang")
HANGS = threading.Semaphore(0)  # one release per `hang` fault, taken by the next env step


def hang_when_armed(step):
    """`GuessNumberEnv.step`, except that a call that takes one of `HANGS` never returns."""

    @functools.wraps(step)
    def chaos_step(env: GuessNumberEnv, action: str):
        if HANGS.acquire(blocking=False):
            threading.Event().wait()
        return step(env, action)

    return chaos_step


class Chaos:
    """The trainer the faults hit now (None while a pre-empted run is being resumed), when the run's
    first step started (start-up is left out of the timings) and when its last step so far ended."""

    def __init__(self) -> None:
        self.trainer: TimedTrainer | None = None
        self.start: float | None = None
        self.steps_end: float | None = None
        self.done = False


class TimedTrainer(Trainer):
    """Records the start of the run's first step in `chaos.start` and the end of each in `chaos.steps_end`;
    `stepping` once this process trains (past its resume: its signal handlers are in place)."""

    chaos: Chaos
    stepping = False

    def train_step(self) -> dict[str, float]:
        if self.chaos.start is None:
            self.chaos.start = time.perf_counter()
        self.stepping = True
        metrics = super().train_step()
        self.chaos.steps_end = time.perf_counter()
        return metrics


def build(overrides: list[str], run_dir: Path, chaos: Chaos) -> TimedTrainer:
    cfg = compose_config(overrides)
    model = resolve_model_path(cfg.trainer.policy.model.path)
    trainer = TimedTrainer(cfg, run_dir, model, load_datasets(cfg, AutoTokenizer.from_pretrained(model)))
    trainer.chaos = chaos
    return trainer


def victims(trainer: Trainer) -> list[tuple[str, Any]]:
    """Every actor a kill may hit now: (name, handle)."""
    actors = [(f"engine {i}", engine) for i, engine in enumerate(trainer.client.engines)]
    for group in trainer.cluster.groups.all():
        actors += [(f"{group.role} rank {r}", a) for r, a in enumerate(group.actors)]
    return actors


def inject(
    chaos: Chaos, offsets: list[float], kinds: list[str], rng: random.Random, faults: list[str]
) -> None:
    """From the first step on, fault `kinds[i]` `offsets[i]` seconds in; stops with the run."""
    while chaos.start is None:
        time.sleep(0.05)
    for offset, kind in zip(offsets, kinds, strict=True):
        while (
            time.perf_counter() < chaos.start + offset or chaos.trainer is None or not chaos.trainer.stepping
        ):
            if chaos.done:
                return
            time.sleep(0.05)
        trainer = chaos.trainer
        if kind == "kill":
            name, actor = rng.choice(victims(trainer))
            ray.kill(actor)
            what = f"killed {name}"
        elif kind == "sigterm":
            chaos.trainer = None  # the next fault waits for the resumed run
            os.kill(os.getpid(), signal.SIGTERM)
            what = "SIGTERM to the driver"
        else:
            HANGS.release()
            what = "the next env step hangs"
        faults.append(f"{time.perf_counter() - chaos.start:6.1f} s, step {trainer.step + 1}: {what}")
        print(f"chaos: {faults[-1]}", flush=True)


def fit_to_the_end(
    overrides: list[str], run_dir: Path, chaos: Chaos
) -> tuple[list[dict[str, float]], float, int]:
    """Train in `run_dir` until `total_steps`, resuming after each pre-emption: the metrics of every
    process, the seconds from the first step to the end and the number of resumes."""
    history: list[dict[str, float]] = []
    resumes = 0
    while True:
        trainer = build(overrides, run_dir, chaos)
        chaos.trainer = trainer
        try:
            history += trainer.fit(stop_on_signals=True)
            preempted = trainer.preempted is not None
        except Preempted:
            preempted = True
        finally:
            chaos.trainer = None
            trainer.shutdown()
        if not preempted:
            chaos.done = True
            return history, time.perf_counter() - (chaos.start or time.perf_counter()), resumes
        resumes += 1
        print(f"chaos: pre-empted at step {trainer.step}; resuming", flush=True)


def checks(run_dir: Path, overrides: list[str], steps: int) -> list[str]:
    """What is wrong with the finished chaos run in `run_dir` (empty: nothing)."""
    problems = []
    logged = [int(r["step"]) for r in read_metrics(run_dir)]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    if logged != list(range(1, steps + 1)) or len(lines) != steps:
        problems.append(
            f"metrics.jsonl holds steps {logged} in {len(lines)} records, not 1..{steps} once each"
        )
    trainer = build(overrides, run_dir, Chaos())  # resume_mode=latest
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
    parser.add_argument("--kills", type=int, default=4, help="how many faults")
    parser.add_argument("--faults", default="kill", help=f"the kinds to draw from, comma-separated: {FAULTS}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ckpt-interval", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value) for both runs")
    args = parser.parse_args()
    kinds_allowed = args.faults.split(",")
    if unknown := [k for k in kinds_allowed if k not in FAULTS]:
        parser.error(f"--faults {unknown}: choose from {FAULTS}")
    overrides = [
        f"trainer.total_steps={args.steps}",
        f"trainer.ckpt_interval={args.ckpt_interval}",
        "trainer.logger=[jsonl]",
        f"trainer.max_restarts={args.kills}",
        f"generator.max_engine_restarts={args.kills}",
        *(["environment.timeout_s=5"] if "hang" in kinds_allowed else []),
        *args.overrides,
    ]
    GuessNumberEnv.step = hang_when_armed(GuessNumberEnv.step)  # in-process env threads: armed faults only
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
    with tempfile.TemporaryDirectory() as tmp:
        undisturbed = Chaos()
        _, baseline, _ = fit_to_the_end(overrides, Path(tmp) / "undisturbed", undisturbed)
        print(f"undisturbed: {args.steps} steps in {baseline:.1f} s", flush=True)
        rng = random.Random(args.seed)
        # while steps train (not in the final export and shutdown, which a short run's time is mostly)
        span = undisturbed.steps_end - undisturbed.start
        offsets = sorted(rng.uniform(0.05, 0.95) * span for _ in range(args.kills))
        # one kind draws nothing: the seeds pick the same kills as before there were kinds
        kinds = (
            [rng.choice(kinds_allowed) for _ in offsets]
            if len(kinds_allowed) > 1
            else kinds_allowed * len(offsets)
        )
        run_dir = Path(tmp) / "chaos"
        chaos, faults = Chaos(), []
        injector = threading.Thread(target=inject, args=(chaos, offsets, kinds, rng, faults), daemon=True)
        injector.start()
        try:
            history, seconds, resumes = fit_to_the_end(overrides, run_dir, chaos)
        except Exception as error:
            print(f"the run failed after {len(faults)} fault(s): {error!r}")
            sys.exit(1)
        injector.join(timeout=1)
        print(
            f"chaos: {len(history)} steps in {resumes + 1} process run(s), {args.steps} in all, in {seconds:.1f} s"
        )
        problems = checks(run_dir, overrides, args.steps)
        if len(faults) < len(offsets):  # e.g. the injector thread raised: a run without faults proves nothing
            problems.append(f"only {len(faults)} of the {len(offsets)} planned faults were injected")
    for problem in problems:
        print(f"check failed: {problem}")
    print(f"faults survived {len(faults)} / {len(offsets)}")
    print(f"overhead {seconds / baseline:.2f}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
