"""Restarting a dead engine of the client (`EngineRestarts`, mixed into `InferenceEngineClient`): a
request or call that finds its engine dead restarts it (up to the client's `max_restarts`), the new
engine gets the current weights, and the callers waiting for it go on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.actor import ActorHandle

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """An engine actor died; the message's first line names the engine, the rest Ray's cause and how
    a program holding the client restarts it."""


class EngineRestarts:
    """Engine restarts for the client it is mixed into. The client provides `_engines` (replaced in
    place), `_factory` (a serving engine for slot i, or None), `max_restarts` and `restarts` (the count),
    the weight state of `EngineWeights` (`_weight_version`, `_latest_weights`, `_in_sync_group`) and the
    hooks `_restore_weights(client)` and `_on_restart(client, index)`; it keeps `_restarting` (restarts
    in progress by engine) and `_restart_lock`."""

    _engines: list[ActorHandle]
    _factory: Callable[[int], ActorHandle] | None
    max_restarts: int
    restarts: int
    _weight_version: int
    _latest_weights: ray.ObjectRef | None
    _in_sync_group: bool
    _restore_weights: Callable[[Any], Awaitable[None]] | None
    _on_restart: Callable[[Any, int], None] | None
    _restarting: dict[int, asyncio.Future]
    _restart_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None

    async def _revive(self, index: int, engine: ActorHandle, error: EngineDeadError) -> None:
        """Restart engine `index` (unless a request that saw it die already did); `EngineDeadError`
        naming the engine and the cause once `max_restarts` restarts were made."""
        async with self._restart_guard():
            if self._engines[index] is not engine:
                return
            if index not in self._restarting:
                if not self.max_restarts:
                    raise error
                lines = str(error).splitlines()
                cause = lines[1] if len(lines) > 1 else lines[0]  # "Ray reports: ..."
                if self.restarts >= self.max_restarts:
                    raise EngineDeadError(
                        f"inference engine {index} died again after {self.restarts} restart(s), the run's "
                        f"limit (generator.max_engine_restarts={self.max_restarts}); last cause: {cause}"
                    ) from error
                logger.warning("inference engine %d died (%s); restarting it", index, cause)
                self.restarts += 1
                self._restarting[index] = asyncio.ensure_future(self._restart_once(index))
            # shielded: a caller cancelled meanwhile (e.g. its draw discarded) leaves the restart running,
            # and the next caller waits for it instead of starting another (and leaking this one's actor)
            await asyncio.shield(self._restarting[index])

    async def _restart_once(self, index: int) -> None:
        try:
            await self.restart_engine(index)
        finally:
            del self._restarting[index]

    def _restart_guard(self) -> asyncio.Lock:
        """The lock every restart holds, on this event loop."""
        loop = asyncio.get_running_loop()
        if self._restart_lock is None or self._restart_lock[0] is not loop:
            self._restart_lock = (loop, asyncio.Lock())
        return self._restart_lock[1]

    async def restart_engine(self, index: int) -> None:
        """Replace engine `index` with a fresh actor that gets the current weights.

        Only for clients built by `from_config`. After `update_weights` the client keeps the latest
        update in the object store and applies it; after a broadcast or shared-memory sync it keeps
        no copy and awaits `restore_weights(client)`, which re-sends the weights to every engine
        (broadcast engines first join a new group: a group has a fixed size); without one the restart
        is refused. Then `on_restart(client, index)` runs in a thread. Requests for the engine wait
        until it holds the current weights (when `generate` restarted it).
        """
        needs_restorer = self._in_sync_group or bool(self._weight_version and self._latest_weights is None)
        if needs_restorer and self._restore_weights is None:
            if self._in_sync_group:
                raise RuntimeError(
                    "engines in a broadcast weight-sync group cannot be restarted one by one (the group has a "
                    "fixed size) without restore_weights to form a new one; restart the run, which resumes "
                    "from its last checkpoint."
                )
            raise RuntimeError(
                f"the engines hold weight version {self._weight_version}, sent through shared memory, and no "
                "copy is kept to restore a restarted engine; restart the run, which resumes from its last "
                "checkpoint, or use weight_sync=object_store."
            )
        if self._factory is None:
            raise RuntimeError(
                "this client was built from actor handles and cannot start engines; "
                "build it with InferenceEngineClient.from_config to restart engines."
            )
        await stop_engine(self._engines[index])
        engine = await asyncio.to_thread(self._factory, index)
        if self._latest_weights is not None:
            await engine.update_weights.remote(self._latest_weights, self._weight_version)
        self._engines[index] = engine  # its requests in flight failed and were counted out
        if needs_restorer:
            assert self._restore_weights is not None
            await self._restore_weights(self)
        if self._on_restart is not None:
            await asyncio.to_thread(self._on_restart, self, index)
        logger.info("restarted inference engine %d", index)


async def stop_engine(engine: ActorHandle, timeout_s: float = 30.0) -> None:
    """End an engine actor: a live one shuts down first (releasing its accelerator memory), at most
    `timeout_s`; then the actor is killed either way."""
    with contextlib.suppress(ray.exceptions.RayError, TimeoutError):  # dead or hanging: the kill ends it
        await asyncio.wait_for(engine.shutdown.remote(), timeout_s)
    ray.kill(engine, no_restart=True)
