"""DaemonThreadPool: an executor whose stuck calls are abandoned at exit instead of joined."""

import asyncio
import subprocess
import sys
import threading

import pytest

from skyrl.train.utils.daemon_pool import DaemonThreadPool, abandoned_calls, abandoned_report


def test_calls_return_results_and_raise_through_their_futures_on_at_most_max_workers_threads():
    pool = DaemonThreadPool(2, "test-pool")
    names = pool.map(lambda _: threading.current_thread().name, range(20))
    assert set(names) <= {"test-pool_0", "test-pool_1"}
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result()
    assert asyncio.run(_in_executor(pool)) == 42
    pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)


async def _in_executor(pool: DaemonThreadPool) -> int:
    return await asyncio.get_running_loop().run_in_executor(pool, int, "42")


def test_a_stuck_call_is_counted_once_its_pool_is_shut_down_and_queued_calls_are_cancelled():
    release = threading.Event()
    pool = DaemonThreadPool(1, "test-stuck")
    stuck = pool.submit_as("Env.step", release.wait)
    queued = pool.submit(print)
    while not pool.running():
        pass
    assert abandoned_calls()["Env.step"] == 0  # running, not yet abandoned
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled() and abandoned_calls()["Env.step"] == 1
    assert "Env.step x1" in abandoned_report()
    release.set()
    assert stuck.result(timeout=5) is True
    pool.shutdown(wait=True)
    assert abandoned_calls()["Env.step"] == 0


def test_a_process_exits_with_a_call_that_never_returns():
    script = (
        "import threading\n"
        "from skyrl.train.utils.daemon_pool import DaemonThreadPool\n"
        "pool = DaemonThreadPool(1, 'p')\n"
        "pool.submit(threading.Event().wait)\n"
        "pool.shutdown(wait=False)\n"
    )
    subprocess.run([sys.executable, "-c", script], timeout=30, check=True)
