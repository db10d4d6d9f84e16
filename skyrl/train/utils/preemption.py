"""Pre-emption: SIGTERM (a cluster scheduler's notice, some seconds before it kills the job: SLURM before
its time limit, Kubernetes, spot instances) or Ctrl-C asks a run to stop at its next step boundary.

Inside `Preemption(grace_s)` the first SIGTERM or SIGINT only records the request; the training loop asks
`at_boundary()` after each step and, when it says so, writes a checkpoint and stops. A step that has not
ended `grace_s` seconds after the signal is abandoned: `Preempted` is raised in the main thread (a
signal wakes it from whatever it waits on), and the last complete checkpoint is what a resume
continues from. A second Ctrl-C raises `KeyboardInterrupt` at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType, TracebackType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped on a signal before its step ended; `signum` is the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class Preemption:
    """SIGTERM and SIGINT handlers for the block (main thread only); the previous handlers come back after it."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signum: int | None = None  # the signal that asked the run to stop
        self._lock = threading.Lock()
        self._boundary = False  # the loop reached a step boundary after the signal: nothing to abandon
        self._expired = False
        self._timer: threading.Timer | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Preemption:
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def at_boundary(self) -> bool:
        """Whether a signal asked the run to stop; from then on the step is no longer abandoned (the
        checkpoint that follows is not cut short)."""
        with self._lock:
            if self.signum is not None:
                self._boundary = True
                if self._timer is not None:
                    self._timer.cancel()
            return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._expired:
            self._expired = False  # raised once
            name = signal.Signals(self.signum).name
            raise Preempted(
                f"{name}, and the step did not end within trainer.preemption_grace_s={self.grace_s:g}: abandoned",
                self.signum,
            )
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signum = signum
        print(
            f"{signal.Signals(signum).name}: stopping after this step with a checkpoint (waiting up to "
            f"trainer.preemption_grace_s={self.grace_s:g} s for the step to end; Ctrl-C again stops now)",
            file=sys.stderr,
            flush=True,
        )
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if self._boundary:
                return
            self._expired = True
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)  # wakes the main thread's wait
