"""The run's checkpoints and exports on disk: the whole layout, in one place.

`<run_dir>/checkpoints/global_step_N/` holds each trained worker group's shards (`policy/`,
`critic/`, written by `skyrl.train.workers.persistence`), the driver's loop state
(`trainer_state.json`) and random generators (`driver_rng.pt`), and the done marker, written
last. A step is saved into `global_step_N.tmp` and renamed once complete, so a kill mid-write
leaves no `global_step_N`; the newest `trainer.max_ckpts_to_keep` complete ones are kept.
`<run_dir>/hf_model/global_step_N/` holds the policy's Hugging Face exports.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch

from skyrl.train.schema import TrainerConfig
from skyrl.train.utils.errors import ConfigError
from skyrl.train.workers.persistence import CHECKPOINT_DONE, is_complete

STEP_PREFIX = "global_step_"
TRAINER_STATE = "trainer_state.json"
DRIVER_RNG = "driver_rng.pt"
# the driver's part of a checkpoint: the loop's state (JSON) and its random generators' states
DriverState = tuple[dict[str, Any], dict[str, Any]]


class Persistent(Protocol):
    """A worker group that saves and loads its shards (an `ActorGroup`)."""

    def save_checkpoint(self, path: str | Path) -> None: ...

    def load_checkpoint(self, path: str | Path) -> None: ...

    def run(self, method: str, *args: Any) -> Any: ...


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint `root/global_step_N` with the largest N; half-written ones are skipped."""
    complete = [
        p
        for p in Path(root).glob(f"{STEP_PREFIX}*")
        if p.is_dir() and p.name[len(STEP_PREFIX) :].isdigit() and is_complete(p)
    ]
    return max(complete, key=lambda p: int(p.name[len(STEP_PREFIX) :]), default=None)


class Checkpoints:
    """Saving, listing, pruning and loading the run's checkpoints, and exporting the policy, by the
    `trainer` section's intervals and resume mode."""

    def __init__(self, run_dir: Path, cfg: TrainerConfig):
        self.root, self.exports, self.cfg = run_dir / "checkpoints", run_dir / "hf_model", cfg

    def check_fresh(self) -> None:
        """`trainer.resume_mode=none` in a directory with checkpoints would delete or mix with them: refuse."""
        previous = self.latest()
        if self.cfg.resume_mode == "none" and previous is not None:
            run_dir = self.root.parent
            raise ConfigError(
                f"trainer.resume_mode=none, but the run directory {run_dir} holds checkpoints of an earlier "
                f"run (latest: {previous.name}); a new run there would delete or mix with them. Give the new run "
                "a directory of its own (hydra.run.dir=...), continue the old one with trainer.resume_mode=latest, "
                f"or delete {self.root}."
            )

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def due(self, step: int) -> bool:
        """Whether `trainer.ckpt_interval` saves after `step`."""
        return bool(self.cfg.ckpt_interval) and step % self.cfg.ckpt_interval == 0

    def save(self, step: int, groups: dict[str, Persistent], driver: DriverState) -> Path:
        """The groups' shards (each under its name) and the driver's state as checkpoint `step`; then prunes."""
        final = self.root / f"{STEP_PREFIX}{step}"
        tmp = Path(f"{final}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, group in groups.items():
            group.save_checkpoint(tmp / name)
        state, rng = driver
        (tmp / TRAINER_STATE).write_text(json.dumps(state))
        torch.save(rng, tmp / DRIVER_RNG)
        (tmp / CHECKPOINT_DONE).touch()
        os.replace(tmp, final)
        complete = sorted(
            self.root.glob(f"{STEP_PREFIX}*[0-9]"), key=lambda p: int(p.name[len(STEP_PREFIX) :])
        )
        for old in complete[: max(0, len(complete) - self.cfg.max_ckpts_to_keep)]:
            shutil.rmtree(old)
        return final

    def to_resume(self) -> Path | None:
        """The checkpoint `trainer.resume_mode` names (`latest`: the newest complete one, if any), or None
        when the run starts afresh."""
        mode = self.cfg.resume_mode
        if mode == "none":
            return None
        path = self.latest() if mode == "latest" else Path(mode)
        if path is not None and not is_complete(path):
            raise FileNotFoundError(f"trainer.resume_mode={mode}: {path} is not a complete checkpoint")
        return path

    def load(self, path: Path, groups: dict[str, Persistent]) -> DriverState:
        """The groups' shards from checkpoint `path`; returns the driver's state saved with them."""
        for name, group in groups.items():
            group.load_checkpoint(path / name)
        return json.loads((path / TRAINER_STATE).read_text()), torch.load(
            path / DRIVER_RNG, weights_only=False
        )

    def export_due(self, step: int) -> bool:
        """Whether the policy is exported after `step`: at `trainer.hf_save_interval` and at the last step."""
        return step == self.cfg.total_steps or bool(
            self.cfg.hf_save_interval and step % self.cfg.hf_save_interval == 0
        )

    def export(self, step: int, policy: Persistent) -> str:
        """The policy in Hugging Face's format under `hf_model/global_step_<step>`; what was written, and where."""
        path = self.exports / f"{STEP_PREFIX}{step}"
        policy.run("save_hf_model", str(path))
        if not self.cfg.policy.lora.rank:
            what = "from_pretrained-ready"
        else:
            merged = ", merged model in merged/" if self.cfg.export_merged else ""
            what = f"LoRA adapter for PeftModel.from_pretrained{merged}"
        return f"exported the policy ({what}): {path}"
