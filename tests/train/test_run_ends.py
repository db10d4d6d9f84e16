"""A run ends: environment or agent calls stuck past their timeout never hold the process after its last
step (issue 29). Each case is a whole `python -m skyrl.train` run in a subprocess."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
EXIT_BOUND_S = 30  # from the last step's metrics record to the process's exit (summary, plot, Ray's shutdown)
STUCK_ENV = "tests.envs.user_envs:StuckEnv"
STUCK_AGENT = "tests.train.generator.user_agents:stuck"

CASES = {
    "env thread": (
        [f"environment.env_class={STUCK_ENV}", "environment.timeout_s=1"],
        f"{STUCK_ENV.split(':')[1]}.step x",
    ),
    "env process": (
        [f"environment.env_class={STUCK_ENV}", "environment.timeout_s=1", "generator.env_executor=process"],
        None,  # the stuck process is killed at the timeout: nothing is left to abandon
    ),
    "sync agent": ([f"generator.agent={STUCK_AGENT}", "generator.agent_timeout_s=2"], f"{STUCK_AGENT} x"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_with_stuck_calls_exits_soon_after_its_last_step(tmp_path, case):
    overrides, abandoned = CASES[case]
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        json.dumps({"prompt": "Go.", "stuck": True}) + "\n" + json.dumps({"prompt": "Go."}) + "\n"
    )
    run_dir = tmp_path / "run"
    args = [
        *overrides,
        f"data.train_path={data}",
        f"trainer.total_steps={STEPS}",
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=2",
        "generator.n_samples_per_prompt=2",
        "generator.max_generate_length=4",
        "generator.max_env_failure_fraction=0.5",
        "generator.inference_engine.backend=hf",
        "trainer.logger=[jsonl]",
        "trainer.ckpt_interval=0",
        "ray.num_cpus=4",
        f"hydra.run.dir={run_dir}",
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "skyrl.train", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= STEPS):
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the steps did not finish"
            time.sleep(0.2)
        try:
            stdout, stderr = process.communicate(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {EXIT_BOUND_S} s after its last step")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["episode/env_failures"] for r in records] == [2, 2]  # the stuck prompt's two samples, per step
    output = stdout + stderr  # the console logger writes to stdout
    if abandoned is None:
        assert "were abandoned" not in output
    else:
        assert "had not returned when the run ended and were abandoned" in output and abandoned in output
