"""A run ends: environment or agent calls stuck past their timeout never hold the process after its last
step (issue 29). Each case is a whole `python -m skyrl.train` run in a subprocess; the three run at once,
joined to the session's Ray cluster (their exit is the subject, not Ray's start-up)."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 1
EXIT_BOUND_S = 30  # from the last step's metrics record to the process's exit (summary, plot, shutdown)
STUCK_ENV = "tests.envs.user_envs:StuckEnv"
STUCK_AGENT = "tests.train.generator.user_agents:stuck"

# case -> (overrides, what the exit warning names as abandoned; None: nothing is left to abandon)
# (timeouts leave room for three runs sharing two cores: a process-hosted env's `make` starts a process)
CASES = {
    "env thread": (
        [f"environment.env_class={STUCK_ENV}", "environment.timeout_s=2"],
        f"{STUCK_ENV.split(':')[1]}.step x",
    ),
    "env process": (
        [f"environment.env_class={STUCK_ENV}", "environment.timeout_s=4", "generator.env_executor=process"],
        None,  # the stuck process is killed at the timeout
    ),
    "sync agent": ([f"generator.agent={STUCK_AGENT}", "generator.agent_timeout_s=4"], f"{STUCK_AGENT} x"),
}


def start(case: str, tmp_path: Path, address: str) -> tuple[subprocess.Popen, Path]:
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        json.dumps({"prompt": "Go.", "stuck": True}) + "\n" + json.dumps({"prompt": "Go."}) + "\n"
    )
    run_dir = tmp_path / case.replace(" ", "_")
    args = [
        *CASES[case][0],
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
        f"ray.address={address}",
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
    return process, run_dir / "metrics.jsonl"


def test_runs_with_stuck_env_or_agent_calls_exit_soon_after_their_last_step(ray_cluster, tmp_path):
    address = ray_cluster.get_runtime_context().gcs_address
    runs = {case: start(case, tmp_path, address) for case in CASES}
    last_step: dict[str, float] = {}
    outputs: dict[str, str] = {}
    try:
        deadline = time.monotonic() + 300
        while len(outputs) < len(runs):
            assert time.monotonic() < deadline, f"unfinished: {sorted(set(runs) - set(outputs))}"
            for case, (process, metrics) in runs.items():
                if case in outputs:
                    continue
                if (
                    case not in last_step
                    and metrics.exists()
                    and len(metrics.read_text().splitlines()) >= STEPS
                ):
                    last_step[case] = time.monotonic()
                if process.poll() is not None:
                    stdout, stderr = process.communicate()
                    assert process.returncode == 0 and case in last_step, f"{case}: {stderr[-3000:]}"
                    outputs[case] = stdout + stderr  # the console logger writes to stdout
                else:
                    assert time.monotonic() < last_step.get(case, math.inf) + EXIT_BOUND_S, (
                        f"{case}: still running {EXIT_BOUND_S} s after its last step"
                    )
            time.sleep(0.2)
    finally:
        for process, _ in runs.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    for case, (_, metrics) in runs.items():
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [r["episode/env_failures"] for r in records] == [2] * STEPS, (
            case
        )  # the stuck prompt's 2 samples
        abandoned = CASES[case][1]
        if abandoned is None:
            assert "were abandoned" not in outputs[case], case
        else:
            assert "had not returned when the run ended and were abandoned" in outputs[case], case
            assert abandoned in outputs[case], case
