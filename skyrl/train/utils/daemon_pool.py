"""A thread pool for user code that may never return (environments, sync agents).

`concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits, so one env
call stuck past its timeout keeps the whole run alive after its last step (and keeps the local Ray
cluster up: Ray's exit handler runs after that join). `DaemonThreadPool`'s threads are daemons that
nothing joins: a call still running at exit is abandoned. `abandoned_calls()` names what was left.
"""

from __future__ import annotations

import collections
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

_POOLS: weakref.WeakSet[DaemonThreadPool] = weakref.WeakSet()


class DaemonThreadPool(Executor):
    """Up to `max_workers` daemon threads, started as calls arrive; usable with `loop.run_in_executor`.
    `shutdown(wait=False, cancel_futures=True)` returns at once and leaves calls that are running to
    finish (or not) on their own."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        self._max_workers, self._prefix = max_workers, thread_name_prefix
        self._calls: queue.SimpleQueue[tuple[Future, str, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)  # threads waiting for a call
        self._lock = threading.Lock()
        self._running: dict[Future, str] = {}  # call -> label, while it runs
        self._shut_down = False
        _POOLS.add(self)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        label = getattr(fn, "__qualname__", type(fn).__qualname__)
        return self.submit_as(label, lambda: fn(*args, **kwargs))

    def submit_as(self, label: str, call: Callable[[], Any]) -> Future:
        """`call()` on a pool thread; `label` names it in `abandoned_calls()`."""
        future: Future = Future()
        with self._lock:
            if self._shut_down:
                raise RuntimeError("cannot submit to a DaemonThreadPool after shutdown")
            self._calls.put((future, label, call))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                thread = threading.Thread(
                    target=self._work, name=f"{self._prefix}_{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
        return future

    def _work(self) -> None:
        while (item := self._calls.get()) is not None:
            future, label, call = item
            if future.set_running_or_notify_cancel():
                self._running[future] = label
                try:
                    result = call()
                except BaseException as e:  # the caller sees it through the future
                    future.set_exception(e)
                else:
                    future.set_result(result)
                finally:
                    del self._running[future]
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shut_down = True
            pending = []
            while cancel_futures:
                try:
                    item = self._calls.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    pending.append(item[0])
            for _ in self._threads:
                self._calls.put(None)  # one stop per thread, behind the calls still queued
        for future in pending:
            future.cancel()
        if wait:
            for thread in self._threads:
                thread.join()

    def running(self) -> list[str]:
        """The labels of the calls running now."""
        return list(self._running.values())


def abandoned_calls() -> collections.Counter[str]:
    """Calls still running in pools that were shut down (left behind past a timeout), by label."""
    return collections.Counter(label for pool in list(_POOLS) if pool._shut_down for label in pool.running())


def abandoned_report() -> str | None:
    """One line naming the calls `abandoned_calls()` counts (None when there are none)."""
    stuck = abandoned_calls()
    if not stuck:
        return None
    calls = ", ".join(f"{label} x{count}" for label, count in stuck.most_common())
    return (
        f"{stuck.total()} environment/agent call(s) had not returned when the run ended and were abandoned "
        f"(their threads do not hold the exit): {calls}"
    )
