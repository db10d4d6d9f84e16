"""Disaggregated CPU runs put each engine and worker on cores of their own (`pin_to_cores`)."""

import os
import threading

import pytest
import ray

from skyrl.train.workers.actor_group import pin_to_cores, unpin_driver


@ray.remote(num_cpus=0)
class Probe:
    def cores(self) -> list[int]:
        return sorted(os.sched_getaffinity(0))

    def new_thread_cores(self) -> list[int]:
        seen = []
        thread = threading.Thread(target=lambda: seen.extend(sorted(os.sched_getaffinity(0))))
        thread.start()
        thread.join()
        return seen


def test_each_actor_gets_cores_of_its_own_and_the_driver_gets_its_cores_back(ray_cluster):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    a, b = Probe.remote(), Probe.remote()
    assert pin_to_cores([(a, 1), (b, len(cores))]) is None  # more cores than the node has: none pinned
    assert ray.get(a.cores.remote()) == cores
    before = pin_to_cores([(a, 1), (b, 1)])
    try:
        assert before == cores
        assert ray.get([a.cores.remote(), b.cores.remote()]) == [[cores[0]], [cores[1]]]
        assert ray.get(b.new_thread_cores.remote()) == [cores[1]]  # threads started later inherit it
        assert sorted(os.sched_getaffinity(0)) == [cores[0]]  # the driver shares the first actor's
        # b replaced (a restart): pinning again with the cores shared out before gives c b's cores
        c = Probe.remote()
        assert pin_to_cores([(a, 1), (c, 1)], before) == before
        assert ray.get(c.cores.remote()) == [cores[1]]
        ray.kill(c)
    finally:
        unpin_driver(before)
    assert sorted(os.sched_getaffinity(0)) == cores
    for probe in (a, b):
        ray.kill(probe)
