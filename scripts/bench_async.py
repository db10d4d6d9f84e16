"""Asynchronous vs synchronous training on the default task, in one process and one Ray cluster.

Runs the default job (`guess_number`, the tiny model) with `placement=disaggregated`, one engine
core and one worker core (`num_cpus_per_engine=1`, `cpus_per_worker=1`, pinned to cores of their
own when the machine has them), for a fixed number of steps at each `max_staleness` (0 is the
synchronous loop), and prints per run: steps/s (after the first `--warmup` steps), the engines'
and workers' idle fractions, the staleness trained on, and the time to +0.3 reward (the first
step whose 10-step mean reward is 0.3 above the first 10 steps' mean, timed by the steps' own
wall time). Last line: `ratio async/sync X`, steps/s at `max_staleness=1` over steps/s at 0.

Usage: python scripts/bench_async.py [--steps 150] [--staleness 0 1 2] [--inflight]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import ray
from transformers import AutoTokenizer

from skyrl.train.cluster import resolve_model_path
from skyrl.train.config import compose_config
from skyrl.train.sampler import load_datasets
from skyrl.train.trainer import Trainer

WINDOW, MARGIN = 10, 0.3


def step_seconds(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("timing/"))


def time_to_margin(history: list[dict[str, float]]) -> float | None:
    """Seconds of training until the 10-step mean reward first reached the first 10 steps' mean + 0.3."""
    rewards = np.array([m["reward/mean"] for m in history])
    elapsed = np.cumsum([step_seconds(m) for m in history])
    target = rewards[:WINDOW].mean() + MARGIN
    for end in range(WINDOW, len(history) + 1):
        if rewards[end - WINDOW : end].mean() >= target:
            return float(elapsed[end - 1])
    return None


def run(staleness: int, inflight: bool, steps: int, run_dir: Path) -> tuple[list[dict[str, float]], bool]:
    overrides = [
        "placement=disaggregated",
        "trainer.placement.cpus_per_worker=1",
        "generator.inference_engine.num_cpus_per_engine=1",
        f"trainer.total_steps={steps}",
        "trainer.logger=[jsonl]",
        "trainer.ckpt_interval=0",
        f"trainer.async_training.max_staleness={staleness}",
        f"generator.inflight_weight_updates={str(inflight).lower()}",
    ]
    cfg = compose_config(overrides)
    model = resolve_model_path(cfg.trainer.policy.model.path)
    trainer = Trainer(cfg, run_dir, model, load_datasets(cfg, AutoTokenizer.from_pretrained(model)))
    try:
        return trainer.fit(), trainer.cluster.pinned_to_cores
    finally:
        trainer.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--inflight", action="store_true", help="also run s >= 1 with in-flight weight updates"
    )
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
    configs = [(s, False) for s in args.staleness]
    if args.inflight:
        configs += [(s, True) for s in args.staleness if s > 0]
    rates: dict[tuple[int, bool], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for s, inflight in configs:
            history, pinned = run(s, inflight, args.steps, Path(tmp) / f"s{s}{'i' if inflight else ''}")
            timed = history[args.warmup :]
            rates[s, inflight] = len(timed) / sum(step_seconds(m) for m in timed)
            reach = time_to_margin(history)

            def mean(key: str, rows: list[dict[str, float]] = timed) -> float:
                return float(np.mean([m.get(key, 0.0) for m in rows]))

            print(
                f"max_staleness={s}{' inflight' if inflight else ''}: {rates[s, inflight]:.3f} steps/s, "
                f"engines idle {mean('idle/engines_fraction'):.2f}, workers idle {mean('idle/workers_fraction'):.2f}, "
                f"staleness mean {mean('async/staleness_mean'):.2f} max {max(m.get('async/staleness_max', 0) for m in history):.0f}, "
                f"dropped {sum(m.get('async/dropped_episodes', 0) for m in history):.0f}, "
                f"reward {mean('reward/mean', history[:WINDOW]):.3f} -> {mean('reward/mean', history[-WINDOW:]):.3f}, "
                f"time to +{MARGIN} reward {f'{reach:.1f} s' if reach is not None else 'not reached'}, "
                f"pinned to cores: {pinned}",
                flush=True,
            )
            phases = {k[7:-2]: mean(k) for k in timed[0] if k.startswith("timing/")}
            print("  seconds per step: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()), flush=True)
    ray.shutdown()
    if (0, False) in rates and (1, False) in rates:
        print(f"ratio async/sync {rates[1, False] / rates[0, False]:.3f}")


if __name__ == "__main__":
    main()
