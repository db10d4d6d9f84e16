"""A local Ray cluster goes away with the driver that started it, however the driver dies.

Ray stops the cluster it started when the driver exits, but not after SIGKILL (an
OOM kill, `kill -9`): its dashboard and runtime-env agents then live on. The driver
starts a watchdog process that keeps track of the driver's descendant processes
and, once the driver is gone, terminates those still running.

`python -m skyrl.train.utils.reaper PID` is the watchdog; its stdin is a pipe whose
other end only the driver holds, so end of file means the driver died.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys

POLL_S = 1.0  # how often the watchdog refreshes the descendants it would terminate
GRACE_S = 3.0  # SIGTERM, then SIGKILL after this long


def reap_descendants_on_exit() -> subprocess.Popen:
    """Start the watchdog for this process (in a session of its own, so a Ctrl-C in the terminal
    reaches only the driver, which then shuts Ray down itself)."""
    # the write end stays open, unreferenced, until this process ends; O_CLOEXEC keeps it out of
    # the processes the driver starts, so none of them keeps the watchdog waiting
    read_end, _ = os.pipe()
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "skyrl.train.utils.reaper", str(os.getpid())],
        stdin=read_end,
        start_new_session=True,
    )
    os.close(read_end)
    return watchdog


def watch(driver_pid: int) -> None:
    """Until stdin closes, remember `driver_pid`'s descendants; then terminate those still alive."""
    import psutil

    driver = psutil.Process(driver_pid)
    known: dict[int, psutil.Process] = {}
    while not select.select([sys.stdin], [], [], POLL_S)[0]:
        try:
            known.update({p.pid: p for p in driver.children(recursive=True) if p.pid != os.getpid()})
        except psutil.NoSuchProcess:
            break
    alive = [p for p in known.values() if p.is_running()]  # is_running also checks the start time
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, still = psutil.wait_procs(alive, timeout=GRACE_S)
    for process in still:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


if __name__ == "__main__":
    watch(int(sys.argv[1]))
