"""Shared fixtures: one local Ray cluster and one tiny model per test session."""

import os

import pytest

# Logical CPUs for the test cluster: actor groups reserve whole CPUs, the box has 2 cores.
RAY_TEST_CPUS = 8


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """The tiny model at HF's initializer_range 0.02: near-uniform logits, so greedy episodes take
    several turns; the layout, engine and loop tests' model."""
    from skyrl.train.utils.tiny_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def default_model_path(tmp_path_factory):
    """The model `python -m skyrl.train` trains by default (`default_tiny_model_path`), built here."""
    from skyrl.train.utils.tiny_model import DEFAULT_INITIALIZER_RANGE, create_tiny_model

    return create_tiny_model(
        tmp_path_factory.mktemp("default-model"), initializer_range=DEFAULT_INITIALIZER_RANGE
    )


@pytest.fixture(scope="session")
def learning_model_path(tmp_path_factory):
    """The anchor's and the asynchronous learning test's model, on which their margins were measured
    (8 seeds each): the tiny model initialised with pretrained-like logit scales (initializer_range
    0.2). The default job on it settles on a deterministic strategy near 0.5 (measured), so it is not
    the default model (0.1)."""
    from skyrl.train.utils.tiny_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("learning-model"), initializer_range=0.2)


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
