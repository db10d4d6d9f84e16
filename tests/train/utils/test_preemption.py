"""SIGTERM / Ctrl-C inside `Preemption`: stop at the step boundary, abandon a step past the grace, and the
CLI's report and exit code (the trainer's side: tests/train/test_trainer.py's resume test)."""

import os
import signal
import threading
import time

import pytest

from skyrl.train.utils.preemption import Preempted, Preemption


def test_the_first_signal_only_asks_for_a_stop_at_the_step_boundary():
    handler = signal.getsignal(signal.SIGTERM)
    with Preemption(grace_s=30) as preemption:
        assert not preemption.at_boundary()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the step goes on
        assert preemption.at_boundary() and preemption.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # a repeated SIGTERM changes nothing
    assert signal.getsignal(signal.SIGTERM) == handler


def test_a_step_that_outlasts_the_grace_is_abandoned_even_while_the_main_thread_waits():
    with (
        Preemption(grace_s=0.5),
        pytest.raises(Preempted, match=r"SIGTERM.*preemption_grace_s=0.5: abandoned") as e,
    ):
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(30)  # a step blocked in a wait: the grace's signal wakes it
    assert e.value.signum == signal.SIGTERM


def test_a_second_ctrl_c_stops_at_once():
    with Preemption(grace_s=30), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)


def test_the_cli_reports_a_preempted_run_with_its_resume_command_and_exits_143(tmp_path, capsys):
    from skyrl.train.__main__ import _or_report
    from skyrl.train.schema import SkyRLConfig

    def preempted():
        raise Preempted("SIGTERM: stopped after step 3 with its checkpoint", signal.SIGTERM)

    (tmp_path / "checkpoints" / "global_step_3").mkdir(parents=True)
    (tmp_path / "checkpoints" / "global_step_3" / "COMPLETE").touch()
    with pytest.raises(SystemExit) as exit_:
        _or_report(SkyRLConfig(), tmp_path, preempted)
    assert exit_.value.code == 143
    err = capsys.readouterr().err
    assert "training stopped: pre-empted (SIGTERM: stopped after step 3 with its checkpoint)" in err
    assert "Resume from global_step_3 with:" in err and f"hydra.run.dir={tmp_path}" in err
