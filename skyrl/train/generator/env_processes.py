"""Environments in worker processes (`generator.env_executor=process`).

`EnvProcessPool` hosts environments in daemonic worker processes, so that an env that segfaults,
calls `os._exit` or hangs takes down only its own process. An env lives in one process for its
whole episode: `make` places it in the least loaded process, and its later calls go there; a
process runs its calls one at a time, in order. Every call returns a `concurrent.futures.Future`
(any event loop awaits it with `asyncio.wrap_future`) that holds the call's result or an
`EnvFailure`. A process that ends (exit code, signal, or `kill` by a caller whose timeout passed)
fails every call of its envs still in flight, and every later one, naming how it ended; the next
`make` starts a new process in its slot.

Processes start with "spawn", never "fork": the driver runs Ray and torch threads. The env class is
resolved in the driver and sent by reference (the worker imports its module); arguments, results
and errors travel pickled. Workers are daemonic and also exit, even in the middle of a call, once
the driver is gone. Like every spawned process, a worker imports the driver's main module when that
is a script file (`python -m skyrl.train` is not): such a script keeps its top level light and its
run under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from skyrl.envs import BaseTextEnv, resolve

_SPAWN = multiprocessing.get_context("spawn")
DRIVER_POLL_S = 1.0  # how often a worker checks that the driver still lives
CLOSE_WAIT_S = 10.0  # how long `close` waits for each killed process to be reaped


class EnvFailure(Exception):
    """An environment call failed (it raised, did not return in time, or its process ended); the
    episode ends with reward 0."""


@dataclass(frozen=True)
class RemoteEnv:
    """An environment living in a worker process of an `EnvProcessPool`."""

    cls: type[BaseTextEnv]
    env_id: int


def _serve(requests: Connection, results: Connection, driver_pid: int) -> None:
    """A worker process: runs the env calls arriving on `requests` one at a time and sends each
    outcome `(call_id, error, pickled result)` on `results`, until `requests` closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle; it stops the pool
    threading.Thread(target=_exit_without, args=(driver_pid,), daemon=True).start()
    envs: dict[int, BaseTextEnv] = {}
    while True:
        try:
            call_id, request = pickle.loads(requests.recv_bytes())
        except EOFError:
            return
        result, error = None, None
        try:
            env_id, method, args = pickle.loads(request)  # imports the env's module on first use
            if method == "make":
                envs[env_id] = args[0](*args[1:])
            else:
                env = envs.pop(env_id) if method == "close" else envs[env_id]
                result = getattr(env, method)(*args)
        except Exception as e:
            error = f"raised {type(e).__name__}: {e}"
        try:
            payload = pickle.dumps(result)
        except Exception as e:
            error, payload = f"returned a {type(result).__name__}, which does not pickle ({e})", b""
        results.send_bytes(pickle.dumps((call_id, error, payload)))


def _exit_without(driver_pid: int) -> None:
    """End this worker once the driver is gone, even while one of its calls hangs."""
    while os.getppid() == driver_pid:
        time.sleep(DRIVER_POLL_S)
    os._exit(1)


@dataclass
class _Call:
    future: Future
    name: str  # as the thread executor's errors name it: "make" or e.g. "GuessNumberEnv.step"
    env: RemoteEnv
    method: str


@dataclass
class _Process:
    """A worker process as the driver sees it: its envs, its calls in flight, and how it ended."""

    process: BaseProcess
    requests: Connection
    results: Connection
    reader: threading.Thread | None = None
    envs: set[int] = field(default_factory=set)
    calls: dict[int, _Call] = field(default_factory=dict)
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    killed: str | None = None  # why the pool killed it
    ended: str | None = None  # e.g. "its environment process (pid 7) died with exit code 1"


class EnvProcessPool:
    """Environments in up to `num_processes` worker processes, each started by the first `make` that
    needs it. Thread-safe; after `close`, a `make` starts new processes."""

    def __init__(self, num_processes: int):
        self._slots: list[_Process | None] = [None] * num_processes
        self._homes: dict[int, _Process] = {}  # env id -> the process hosting it, until its close
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def make(
        self, env_class: str, env_config: dict[str, Any] | None, extras: dict[str, Any] | None
    ) -> Future:
        """A new env, as `skyrl.envs.make(env_class, env_config, extras)` builds it, in the least loaded
        process; the future holds its `RemoteEnv` or an `EnvFailure` ("make raised ...")."""
        try:
            cls = resolve(env_class)
        except Exception as e:
            return _failed(f"make raised {type(e).__name__}: {e}")
        with self._lock:
            slot = min(range(len(self._slots)), key=self._load)
            if self._slots[slot] is None:
                self._slots[slot] = self._start()
            process = self._slots[slot]
            env = RemoteEnv(cls, next(self._ids))
            process.envs.add(env.env_id)
            self._homes[env.env_id] = process
            return self._submit(process, env, "make", (cls, env_config, extras))

    def call(self, env: RemoteEnv, method: str, *args: Any) -> Future:
        """`env.<method>(*args)` in the process hosting `env`; the future holds the result or an
        `EnvFailure` (the env raised, the result does not pickle, or the process has ended)."""
        with self._lock:
            return self._submit(self._homes[env.env_id], env, method, args)

    def kill(self, future: Future, reason: str) -> None:
        """Kill the process running the call of `future`, if it still runs: every call of its envs
        fails, naming `reason`, and its slot takes a new process at the next `make`."""
        with self._lock:
            for slot, process in enumerate(self._slots):
                if process is not None and any(c.future is future for c in process.calls.values()):
                    process.killed = f"was killed after {reason}"
                    self._slots[slot] = None
                    process.process.kill()
                    return

    def close(self) -> None:
        """Kill every process (their calls in flight fail) and wait until they are reaped."""
        with self._lock:
            processes = [p for p in self._slots if p is not None]
            self._slots = [None] * len(self._slots)
        for process in processes:
            process.killed = "was stopped (the pool closed)"
            process.process.kill()
        for process in processes:
            process.reader.join(CLOSE_WAIT_S)

    def _load(self, slot: int) -> int:
        process = self._slots[slot]
        return 0 if process is None else len(process.envs)

    def _start(self) -> _Process:
        requests_out, requests = _SPAWN.Pipe(duplex=False)
        results, results_in = _SPAWN.Pipe(duplex=False)
        child = _SPAWN.Process(
            target=_serve, args=(requests_out, results_in, os.getpid()), daemon=True, name="skyrl-env"
        )
        child.start()
        requests_out.close()  # the child's ends: closed here, so that the child's exit closes the pipes
        results_in.close()
        process = _Process(child, requests, results)
        process.reader = threading.Thread(target=self._read, args=(process,), daemon=True)
        process.reader.start()
        threading.Thread(target=_write, args=(process,), daemon=True).start()
        return process

    def _submit(self, process: _Process, env: RemoteEnv, method: str, args: tuple) -> Future:
        """Queue `env.<method>(*args)` for `process`, or fail it at once (under the lock)."""
        future: Future = Future()
        future.set_running_or_notify_cancel()  # the call runs whatever its caller does: not cancellable
        call = _Call(
            future, "make" if method == "make" else getattr(env.cls, method).__qualname__, env, method
        )
        try:
            request = pickle.dumps((env.env_id, method, args))
        except Exception as e:
            self._forget(call, failed=True)
            future.set_exception(EnvFailure(f"{call.name}: its arguments do not pickle ({e})"))
            return future
        if process.ended is not None:
            self._forget(call, failed=True)
            future.set_exception(EnvFailure(f"{call.name}: {process.ended}"))
            return future
        call_id = next(self._ids)
        process.calls[call_id] = call
        process.outbox.put(pickle.dumps((call_id, request)))
        return future

    def _forget(self, call: _Call, failed: bool) -> None:
        """Drop the env of `call` once its make failed or its close finished (under the lock)."""
        if call.method == "close" or (call.method == "make" and failed):
            self._homes.pop(call.env.env_id).envs.discard(call.env.env_id)

    def _read(self, process: _Process) -> None:
        """Settle `process`'s calls as their outcomes arrive; once it has ended, fail the others."""
        try:
            while process.results in wait([process.results, process.process.sentinel]):
                call_id, error, payload = pickle.loads(process.results.recv_bytes())
                if error is None:
                    try:
                        result = pickle.loads(payload)
                    except Exception as e:  # e.g. a class the driver cannot import
                        error = f"returned a result the driver cannot unpickle ({e})"
                with self._lock:
                    call = process.calls.pop(call_id)
                    self._forget(call, failed=error is not None)
                if error is not None:
                    call.future.set_exception(EnvFailure(f"{call.name} {error}"))
                else:
                    call.future.set_result(call.env if call.method == "make" else result)
        except (EOFError, OSError):
            pass  # the process ended
        process.process.join()
        with self._lock:
            process.ended = f"its environment process (pid {process.process.pid}) {_how(process)}"
            self._slots = [None if p is process else p for p in self._slots]
            calls = list(process.calls.values())
            process.calls.clear()
            for call in calls:
                self._forget(call, failed=True)
        for call in calls:
            call.future.set_exception(EnvFailure(f"{call.name}: {process.ended}"))
        process.outbox.put(None)
        process.results.close()


def _how(process: _Process) -> str:
    """How `process` ended, as its envs' errors say it."""
    code = process.process.exitcode
    if process.killed is not None:
        return process.killed
    if code is not None and code < 0:
        return f"was killed by signal {-code} ({signal.strsignal(-code)})"
    return f"died with exit code {code}"


def _write(process: _Process) -> None:
    """Send `process`'s requests in order, from a thread of its own: a busy or stuck process never
    blocks the caller."""
    while (request := process.outbox.get()) is not None:
        try:
            process.requests.send_bytes(request)
        except OSError:  # the process ended: its reader fails the calls
            break
    process.requests.close()


def _failed(message: str) -> Future:
    future: Future = Future()
    future.set_exception(EnvFailure(message))
    return future
