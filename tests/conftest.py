"""Shared fixtures: one local Ray cluster and one tiny model per test session."""

import pytest

# Logical CPUs for the test cluster: actor groups reserve whole CPUs, the box has 2 cores.
RAY_TEST_CPUS = 8


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from skyrl.train.utils.tiny_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(num_cpus=RAY_TEST_CPUS, include_dashboard=False, log_to_driver=True, logging_level="warning")
    yield ray
    ray.shutdown()
