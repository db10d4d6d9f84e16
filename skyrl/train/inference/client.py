"""Engines as Ray actors, and the client that routes requests and pushes weights to them.

Routing: a request with a `session_id` (e.g. a trajectory id) goes to the engine
that served the session before, so every turn of a trajectory reuses that
engine's prefix cache; a new session or a request without one goes to the engine
with the fewest requests in flight (ties: the one routed to least often).

Weight updates (three paths behind one version counter) are `engine_weights.EngineWeights`, restarting
a dead engine with the current weights `engine_restarts.EngineRestarts`; both are mixed into the client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any

import ray
from ray.actor import ActorHandle

from skyrl.train.inference.config import ENGINE_KEY, resolve_backend, validate_engine_config
from skyrl.train.inference.engine import EngineHealth, GenerationOutput, SamplingParams
from skyrl.train.inference.engine_restarts import EngineDeadError, EngineRestarts
from skyrl.train.inference.engine_weights import EngineWeights, gather
from skyrl.train.schema import InferenceEngineConfig

logger = logging.getLogger(__name__)


# A restarted engine may fail its start while its predecessor's process still holds the GPU memory
# (ray.kill returns before the process has exited): it is started again after a pause.
RESTART_ATTEMPTS = 3
RESTART_BACKOFF_S = 10.0


def wait_until_serving(
    engines: Sequence[ActorHandle], cfg: InferenceEngineConfig, resources: Mapping[str, float] | None
) -> None:
    """Wait for every engine's first health answer, at most `cfg.start_timeout_s`; past it the engines
    are killed and a `TimeoutError` names what each asked for and what the cluster has free (an engine
    whose GPUs no node has free waits in Ray's queue forever)."""
    try:
        ray.get([e.health.remote() for e in engines], timeout=cfg.start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        for engine in engines:
            ray.kill(engine, no_restart=True)
        asked = {"num_cpus": cfg.num_cpus_per_engine} | (
            {"num_gpus": cfg.tensor_parallel_size} if cfg.device == "cuda" else {}
        )
        asked |= dict(resources or {})
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        raise TimeoutError(
            f"{len(engines)} inference engine(s) did not serve within {ENGINE_KEY}.start_timeout_s="
            f"{cfg.start_timeout_s:g} s; each asks for {asked}, the cluster has {free} free. Free or add "
            f"GPUs (disaggregated engines need num_engines x tensor_parallel_size of their own), or raise "
            "start_timeout_s if the engines are only slow to start."
        ) from None


def _engine_class(backend: str) -> type:
    if backend == "vllm":
        from skyrl.train.inference.vllm_engine import VLLMEngine

        return VLLMEngine
    from skyrl.train.inference.hf_engine import HFEngine

    return HFEngine


def create_engine(
    cfg: InferenceEngineConfig,
    model_path: str,
    scheduling_strategy: Any = None,
    resources: Mapping[str, float] | None = None,
) -> ActorHandle:
    """Start one engine actor for a resolved config (`backend` is `vllm` or `hf`, `device` is `cpu` or `cuda`).

    `resources` (`num_cpus`, `num_gpus`) replaces the default of `num_cpus_per_engine` CPUs and, on
    cuda, `tensor_parallel_size` GPUs (e.g. a fraction of a bundle shared with training workers)."""
    options: dict[str, Any] = {"num_cpus": cfg.num_cpus_per_engine}
    if cfg.device == "cuda":
        options["num_gpus"] = cfg.tensor_parallel_size
    options.update(resources or {})
    if scheduling_strategy is not None:
        options["scheduling_strategy"] = scheduling_strategy
    actor_class = ray.remote(_engine_class(cfg.backend))
    return actor_class.options(**options).remote(cfg, str(model_path))


def resolve_engine_config(
    cfg: InferenceEngineConfig, cluster_gpus: float | None = None
) -> InferenceEngineConfig:
    """Validate `cfg` and pin `backend` and `device` (`auto` resolved against what is installed and the
    cluster's `cluster_gpus`, by default asked of Ray)."""
    validate_engine_config(cfg)
    device = cfg.device
    if device == "auto":
        gpus = ray.cluster_resources().get("GPU", 0) if cluster_gpus is None else cluster_gpus
        device = "cuda" if gpus >= cfg.tensor_parallel_size else "cpu"
    return dataclasses.replace(cfg, backend=resolve_backend(cfg), device=device)


class InferenceEngineClient(EngineRestarts, EngineWeights):
    """Routes generation over N engine actors and keeps them in sync.

    Use it from one event loop at a time (a fresh `asyncio.run` per call is fine).
    Engine failures surface as `EngineDeadError`; `ValueError`s raised by an engine
    (bad prompt, bad weight update) are re-raised as themselves.
    """

    def __init__(
        self,
        engines: Sequence[ActorHandle],
        max_concurrent_requests: int = 1024,
        engine_factory: Callable[[int], ActorHandle] | None = None,  # a serving engine for slot i
        max_sessions: int = 100_000,
        ranks_per_engine: int = 1,
        max_restarts: int = 0,
        starting: Callable[[], None] | None = None,  # blocks until the engines serve (`from_config`)
        restore_weights: Callable[[InferenceEngineClient], Awaitable[None]] | None = None,
        on_restart: Callable[[InferenceEngineClient, int], None] | None = None,
    ) -> None:
        assert engines, "a client needs at least one engine"
        self._engines = list(engines)
        self._factory = engine_factory
        self._max_concurrent = max_concurrent_requests
        self._max_sessions = max_sessions
        self._in_flight = [0] * len(engines)
        self._routed = [0] * len(engines)
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._queued: dict[int, list[tuple[list[int], SamplingParams, asyncio.Future]]] = {}
        self._flush_with_send: set[int] = set()  # engines whose queued requests go with `flush`
        self._limiter: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._weight_version = 0
        self._latest_weights: ray.ObjectRef | None = None
        self._ranks_per_engine = ranks_per_engine
        self._in_sync_group = False
        self.max_restarts = (
            max_restarts  # dead engines `generate` restarts itself (generator.max_engine_restarts)
        )
        self.restarts = 0
        # re-sends the sender's current weights to every engine at `weight_version` (broadcast: in a new
        # group), for the syncs that keep no copy; without it their engines are not restarted
        self._restore_weights = restore_weights
        # called (in a thread) with a restarted engine's index, e.g. to pin it to cores
        self._on_restart = on_restart
        self._restarting: dict[int, asyncio.Future] = {}  # restarts in progress, by engine index
        self._restart_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._starting = starting

    @classmethod
    def from_config(
        cls,
        cfg: InferenceEngineConfig,
        model_path: str,
        scheduling_strategies: Sequence[Any] | None = None,
        resources: Mapping[str, float] | None = None,
        max_restarts: int = 0,
        wait: bool = True,
        restore_weights: Callable[[InferenceEngineClient], Awaitable[None]] | None = None,
        on_restart: Callable[[InferenceEngineClient, int], None] | None = None,
    ) -> InferenceEngineClient:
        """Start `cfg.num_engines` engine actors, wait until they serve, and return a client that can restart them.

        `scheduling_strategies[i]` (e.g. a placement group bundle) places engine i; `resources` as in
        `create_engine`; `max_restarts` dead engines are restarted by `generate` itself. With
        `wait=False` the engines start while the caller goes on; it calls `wait_until_serving` before use.
        `restore_weights` and `on_restart` are the restart hooks (`restart_engine`).
        """
        cfg = resolve_engine_config(cfg)
        strategies = list(scheduling_strategies or [None] * cfg.num_engines)
        assert len(strategies) == cfg.num_engines, "one scheduling strategy per engine"

        def start(index: int) -> ActorHandle:
            return create_engine(cfg, model_path, strategies[index], resources)

        engines = [start(i) for i in range(cfg.num_engines)]  # they start in parallel

        def starting() -> None:
            wait_until_serving(engines, cfg, resources)
            logger.info(
                "inference backend: %s, %d engine(s) on %s, tensor parallel %d, model %s",
                cfg.backend,
                cfg.num_engines,
                cfg.device,
                cfg.tensor_parallel_size,
                model_path,
            )

        client = cls(
            engines,
            cfg.max_concurrent_requests,
            partial(_restarted, start, cfg, resources),
            ranks_per_engine=cfg.tensor_parallel_size,
            max_restarts=max_restarts,
            starting=starting,
            restore_weights=restore_weights,
            on_restart=on_restart,
        )
        if wait:
            client.wait_until_serving()
        return client

    def wait_until_serving(self) -> None:
        """Block until the engines that `from_config(wait=False)` started serve (the module's
        `wait_until_serving`: a `TimeoutError` past `start_timeout_s`); then a no-op."""
        if self._starting is not None:
            starting, self._starting = self._starting, None
            starting()

    @property
    def num_engines(self) -> int:
        return len(self._engines)

    @property
    def engines(self) -> tuple[ActorHandle, ...]:
        """The engine actors, in engine order (a restart replaces one)."""
        return tuple(self._engines)

    @property
    def weight_version(self) -> int:
        """The version of the last update every engine accepted (0: the checkpoint's weights)."""
        return self._weight_version

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._limiter is None or self._limiter[0] is not loop:
            self._limiter = (loop, asyncio.Semaphore(self._max_concurrent))
        return self._limiter[1]

    def _route(self, session_id: str | None) -> int:
        if session_id is not None and session_id in self._sessions:
            self._sessions.move_to_end(session_id)
            return self._sessions[session_id]
        index = min(range(len(self._engines)), key=lambda i: (self._in_flight[i], self._routed[i]))
        if session_id is not None:
            self._sessions[session_id] = index
            if len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return index

    def end_session(self, session_id: str) -> None:
        """Forget a finished session's engine (sessions are also evicted oldest-first past `max_sessions`)."""
        self._sessions.pop(session_id, None)

    async def _call(self, index: int, method: str, *args: Any) -> Any:
        try:
            return await getattr(self._engines[index], method).remote(*args)
        except ray.exceptions.RayActorError as exc:
            raise EngineDeadError(
                f"inference engine {index} is dead.\nRay reports: {exc}\n"
                f"A program that holds the client can restart it: `await client.restart_engine({index})`."
            ) from exc
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, ValueError):
                raise exc.cause from None
            raise

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        session_id: str | None = None,
        flush: bool = False,
    ) -> GenerationOutput:
        """Generate on one engine (sticky per `session_id`); waits while `max_concurrent_requests` are in flight.
        With `flush`, `flush()` once the request is queued.

        When the engine dies, the request is issued again (the same prompt ids, so an episode continues
        token-exact) on the engine restarted with the current weights, while fewer than `max_restarts`
        restarts were made; otherwise `EngineDeadError`.
        """
        prompt = list(prompt_token_ids)
        async with self._semaphore():
            while True:
                index = self._route(session_id)
                if index in self._restarting:  # its engine is being replaced and given the current weights
                    await asyncio.shield(self._restarting[index])
                engine = self._engines[index]
                self._in_flight[index] += 1
                self._routed[index] += 1
                try:
                    return await self._submit(index, prompt, sampling_params, flush)
                except EngineDeadError as error:
                    dead = error
                finally:
                    self._in_flight[index] -= 1
                await self._revive(index, engine, dead)

    async def _submit(
        self, index: int, prompt: list[int], params: SamplingParams, flush: bool
    ) -> GenerationOutput:
        """Queue one request for engine `index`; every request queued in the same event-loop step
        travels in one `generate_batch` call (a Ray call costs ~0.5 ms, a 100-request turn ~50 ms)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        queue = self._queued.setdefault(index, [])
        queue.append((prompt, params, future))
        if len(queue) == 1:
            loop.call_soon(self._send_queued, index)
        if flush:
            self.flush()
        return await future

    def _send_queued(self, index: int) -> None:
        requests = self._queued.pop(index)
        flush = index in self._flush_with_send
        self._flush_with_send.discard(index)
        call = asyncio.ensure_future(
            self._call(index, "generate_batch", [r[0] for r in requests], [r[1] for r in requests], flush)
        )

        def resolve(done: asyncio.Future) -> None:
            if done.cancelled():  # e.g. the loop is shutting down: so are the requests
                for _, _, future in requests:
                    future.cancel()
                return
            error = done.exception()
            results = [error] * len(requests) if error is not None else done.result()
            for (_, _, future), result in zip(requests, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

        call.add_done_callback(resolve)

    def flush(self) -> None:
        """The caller sends no request until some of those in flight return (e.g. every episode of a batch
        waits for its turn's output): engines holding requests start them now instead of waiting for more
        (the `hf` engine's batching window). Requests still queued in this event-loop step carry it in
        their call; an engine with none queued gets a call of its own, which Ray may start before requests
        sent just before it (the engine then waits its window, as without the hint)."""
        for index, count in enumerate(self._in_flight):
            if index in self._queued:
                self._flush_with_send.add(index)
            elif count:
                # a dead engine is found (and restarted) by its requests: nothing to report here
                call = asyncio.ensure_future(self._call(index, "flush"))
                call.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def _call_all(self, method: str, *args: Any, revive: bool = False) -> list[Any]:
        """`method(*args)` on every engine; with `revive`, an engine found dead is restarted (while the
        run has restarts left, as in `generate`) and called again."""

        async def call(index: int) -> Any:
            while True:
                engine = self._engines[index]
                try:
                    return await self._call(index, method, *args)
                except EngineDeadError as error:
                    if not revive:
                        raise
                    await self._revive(index, engine, error)

        return await gather(*(call(i) for i in range(len(self._engines))))

    async def reset_prefix_cache(self) -> None:
        """Reset every engine's prefix cache."""
        await self._call_all("reset_prefix_cache", revive=True)

    async def sleep(self) -> None:
        """Put every engine to sleep (requests in flight return `stop_reason="abort"`)."""
        await self._call_all("sleep", revive=True)

    async def wake_up(self) -> None:
        """Wake every engine."""
        await self._call_all("wake_up", revive=True)

    async def health(self) -> list[EngineHealth]:
        """Every engine's health, in engine order; `EngineDeadError` if one is dead."""
        return await self._call_all("health")

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Shut every engine down (reaping its child processes), then kill the actors."""
        pending = [e.shutdown.remote() for e in self._engines]
        try:
            ray.get(pending, timeout=timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            logger.warning("an inference engine did not shut down cleanly: %s", exc)
        for engine in self._engines:
            ray.kill(engine, no_restart=True)


def _restarted(
    start: Callable[[int], ActorHandle],
    cfg: InferenceEngineConfig,
    resources: Mapping[str, float] | None,
    index: int,
) -> ActorHandle:
    """A new serving engine for slot `index`; its predecessor's process may still hold the GPU memory, so a
    failed start is tried again."""
    for _ in range(RESTART_ATTEMPTS - 1):
        engine = start(index)
        try:
            wait_until_serving([engine], cfg, resources)
            return engine
        except ray.exceptions.RayActorError as error:
            logger.warning("a restarted engine %d failed to start (%s); trying again", index, error)
            time.sleep(RESTART_BACKOFF_S)
    engine = start(index)
    wait_until_serving([engine], cfg, resources)
    return engine
