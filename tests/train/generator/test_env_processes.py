"""The env process pool on its own, without an engine."""

import pytest

from skyrl.train.generator.env_processes import EnvFailure, EnvProcessPool


def test_a_result_that_does_not_pickle_fails_its_call_and_the_process_serves_on():
    pool = EnvProcessPool(1)
    try:
        env = pool.make("tests.envs.user_envs:UnpicklableMetricsEnv", {}, {}).result(30)
        with pytest.raises(
            EnvFailure, match=r"^UnpicklableMetricsEnv.get_metrics returned a dict, which does not pickle"
        ):
            pool.call(env, "get_metrics").result(30)
        assert pool.call(env, "step", "four").result(30).reward == 4.0
    finally:
        pool.close()
