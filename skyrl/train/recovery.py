"""Restoring a run: from a checkpoint on resume, and after a worker died.

The driver's part of a checkpoint is the state of each stateful component (the step, the weight
version, the loader's position, the KL coefficient) and the driver's random generators
(`driver_state`); `Checkpoints` writes it beside the workers' shards. `restore` loads both and
sends the restored policy to the engines. A dead worker breaks its group's collectives, so
`restart_workers` restarts every worker group on the same bundles and restores the last complete
checkpoint (or the run's start), at most `trainer.max_restarts` times a run.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from skyrl.train.checkpoints import Checkpoints, DriverState
from skyrl.train.cluster import Cluster, WorkerGroups
from skyrl.train.engines import Engines
from skyrl.train.ppo_update import PPOUpdate
from skyrl.train.sampler import Sampler
from skyrl.train.schema import TrainerConfig
from skyrl.train.weight_sync import WeightSync
from skyrl.train.workers.actor_group import WorkerDiedError

logger = logging.getLogger(__name__)


class Recovery:
    """The driver's checkpointed state (`driver_state`, `restore`) and worker restarts (`restart_workers`);
    owns the count of restarts."""

    def __init__(
        self,
        cfg: TrainerConfig,
        cluster: Cluster,
        engines: Engines,
        checkpoints: Checkpoints,
        sampler: Sampler,
        update: PPOUpdate,
        weight_sync: WeightSync,
    ):
        self.limit = cfg.max_restarts
        self.cluster, self.engines, self.checkpoints = cluster, engines, checkpoints
        self.sampler, self.update, self.weight_sync = sampler, update, weight_sync
        self.restarts = 0
        self._initial = self.driver_state(0)  # what a worker restart before any checkpoint returns to

    @property
    def groups(self) -> WorkerGroups:
        assert self.cluster.groups is not None, "recovery before the workers started"
        return self.cluster.groups

    def driver_state(self, step: int) -> DriverState:
        """What a checkpoint holds of the driver at `step`: the components' state (JSON) and the random
        generators."""
        state: dict[str, Any] = {
            "step": step,
            **self.weight_sync.state_dict(),
            **self.sampler.state_dict(),
            **self.update.state_dict(),
        }
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        return state, rng

    def restore(self, path: Path | None) -> int:
        """Workers and driver from checkpoint `path`, or the state the run started in when None (the workers
        must be new then); then the engines get the restored policy's weights. Returns the step."""
        state, rng = self._initial if path is None else self.checkpoints.load(path, self.groups.trained())
        self.weight_sync.load_state_dict(state, self.engines.client.weight_version)
        self.sampler.load_state_dict(state)
        self.update.load_state_dict(state)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        self.weight_sync.sync(self.engines, self.sampler.stream)
        return state["step"]

    def restart_workers(self, error: WorkerDiedError) -> tuple[Path | None, int]:
        """After a worker died: stop generating ahead, restart every worker group (their collectives are
        broken), set up the weight sync with the new policy, wake colocated engines (a worker may have
        died while they slept) and restore the last complete checkpoint, so the steps after it run again
        as after a resume; a worker that dies meanwhile costs another restart. Returns the checkpoint
        (None: the run's start) and its step; `WorkerDiedError` naming `trainer.max_restarts` once the
        run has used its restarts."""
        while True:
            if self.restarts >= self.limit:
                used = f"trainer.max_restarts={self.limit}" + (", all used" if self.limit else "")
                raise WorkerDiedError(
                    error.role, error.ranks, error.method, f"{error.cause} ({used})"
                ) from error
            self.restarts += 1
            checkpoint = self.checkpoints.latest()
            logger.warning(
                "%s; restarting the workers from %s (restart %d of trainer.max_restarts=%d)",
                error,
                checkpoint.name if checkpoint else "the start of the run (no checkpoint yet)",
                self.restarts,
                self.limit,
            )
            self.sampler.stop_stream()
            try:
                self.cluster.restart_workers(self.engines.client.engines)
                self.weight_sync.rejoin(self.engines)
                if self.cluster.colocated:
                    self.engines.run(self.engines.client.wake_up())
                return checkpoint, self.restore(checkpoint)
            except WorkerDiedError as again:
                error = again
