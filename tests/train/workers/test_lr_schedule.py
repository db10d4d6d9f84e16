import math

import pytest

from skyrl.train.schema import OptimizerConfig
from skyrl.train.workers.fsdp_worker import _lr_lambda


def test_constant_schedule_with_linear_warmup():
    f = _lr_lambda(OptimizerConfig(scheduler="constant", warmup_steps=4))
    assert [f(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_schedule_warms_up_then_decays_to_the_floor():
    f = _lr_lambda(OptimizerConfig(scheduler="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1))
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0)
    assert f(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(12) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)


def test_bad_schedules_are_named():
    with pytest.raises(ValueError, match="total_steps > warmup_steps"):
        _lr_lambda(OptimizerConfig(scheduler="cosine", warmup_steps=5, total_steps=5))
    with pytest.raises(ValueError, match=r"unknown optimizer\.scheduler='linear'"):
        _lr_lambda(OptimizerConfig(scheduler="linear"))
