"""Shared fixtures: one local Ray cluster and one tiny model per test session."""

import os

import pytest

# Logical CPUs for the test cluster: actor groups reserve whole CPUs, the box has 2 cores.
RAY_TEST_CPUS = 8


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from skyrl.train.utils.tiny_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def small_init_model_path(tmp_path_factory):
    """The tiny model with Hugging Face's initializer_range 0.02 instead of the default 0.2: its logits
    are ~10x smaller, and so are float summation-order differences. The layout equivalence tests keep
    their 1e-5 bound on it (on the default model prefix-shared layouts' gradients differ by 1.1e-5)."""
    from skyrl.train.utils.tiny_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("small-init-model"), initializer_range=0.02)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(num_cpus=RAY_TEST_CPUS, include_dashboard=False, log_to_driver=True, logging_level="warning")
    yield ray
    ray.shutdown()


def pytest_generate_tests(metafunc):
    """A learning test runs with seed 0, or with each seed of `SKYRL_LEARNING_SEEDS=FIRST-LAST` (e.g.
    `0-7`, to check that its margin holds across seeds; it prints each run's margin)."""
    if "learning_seed" in metafunc.fixturenames:
        first, _, last = os.environ.get("SKYRL_LEARNING_SEEDS", "0").partition("-")
        metafunc.parametrize("learning_seed", range(int(first), int(last or first) + 1))
