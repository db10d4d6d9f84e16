"""Metric sinks: console, a JSONL file in the run directory, TensorBoard, wandb."""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from skyrl.train.utils.errors import ConfigError

BACKENDS = ("console", "jsonl", "tensorboard", "wandb")
METRICS_FILE = "metrics.jsonl"


class Tracker:
    """Logs a dict of scalars per step to every configured backend."""

    def __init__(
        self, backends: list[str], run_dir: str | Path, project: str, run_name: str, config: dict[str, Any]
    ):
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ConfigError(
                f"trainer.logger={backends} has unknown backends {unknown}; choose from {list(BACKENDS)}"
            )
        self.backends = list(backends)
        self.run_dir = Path(run_dir)
        self._jsonl = (self.run_dir / METRICS_FILE).open("a") if "jsonl" in backends else None
        self._tb = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self._wandb = None
        if "wandb" in backends:
            import wandb

            # a resumed run (same run directory) continues the same wandb run
            id_file = self.run_dir / "wandb" / "run_id"
            run_id = id_file.read_text() if id_file.exists() else secrets.token_hex(4)
            self._wandb = wandb.init(
                project=project,
                name=run_name,
                config=config,
                dir=str(self.run_dir),
                id=run_id,
                resume="allow",
            )
            id_file.write_text(run_id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def rewind(self, step: int) -> int:
        """Drop the JSONL records after `step` (a resumed run logs those steps again); returns how many."""
        if self._jsonl is None:
            return 0
        self._jsonl.close()
        path = self.run_dir / METRICS_FILE
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        kept = [line for line in lines if json.loads(line)["step"] <= step]
        path.write_text("".join(f"{line}\n" for line in kept))
        self._jsonl = path.open("a")
        return len(lines) - len(kept)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """The JSONL metrics of a run, one dict per logged step; the last record of a step wins (resumes)."""
    by_step: dict[int, dict[str, float]] = {}
    path = Path(run_dir) / METRICS_FILE
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step.setdefault(int(record["step"]), {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


def step_line(step: int, m: dict[str, Any]) -> str:
    """The console line of a step's metrics `m`."""
    timing = " ".join(
        f"{k[7:-2]} {v:.1f}s" for k, v in m.items() if k.startswith("timing/") and k != "timing/generate_s"
    )
    return (
        f"step {step}: reward {m['reward/mean']:.3f} turns {m['episode/turns']:.2f} "
        f"generate {m['timing/generate_s']:.1f}s {timing} grad_norm {m.get('policy/grad_norm', float('nan')):.3f}"
    )


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Time the block into `timings[name]` (seconds)."""
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start
