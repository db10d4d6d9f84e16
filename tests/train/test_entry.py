"""`python -m skyrl.train` configuration: presets, schema checks and one readable error per mistake."""

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from skyrl.train.config import compose_config
from skyrl.train.utils.errors import ConfigError


def test_default_config_is_the_cpu_demo():
    cfg = compose_config([])
    assert cfg.trainer.policy.model.path == "tiny"
    assert cfg.environment.env_class == "guess_number"
    assert cfg.generator.step_wise and cfg.trainer.algorithm.advantage_estimator == "grpo"
    assert cfg.generator.env_failure == "mask"  # an episode whose env raised is not trained on


@pytest.mark.parametrize(
    ("preset", "key", "value"),
    [
        ("algorithm=ppo", "advantage_estimator", "gae"),
        ("algorithm=rloo", "advantage_estimator", "rloo"),
        ("algorithm=reinforce_pp", "advantage_estimator", "reinforce++"),
        ("placement=disaggregated", "colocate_all", False),
    ],
)
def test_presets_set_their_keys(preset, key, value):
    cfg = compose_config([preset])
    section = cfg.trainer.placement if key == "colocate_all" else cfg.trainer.algorithm
    assert getattr(section, key) == value


# (overrides, the message must match) — each a different kind of mistake
AGENT = "examples.openai_agent.agent:play"
BAD_CONFIGS = [
    (
        ["trainer.train_batch_sise=8"],
        r"unknown config key 'trainer.train_batch_sise'; did you mean trainer.train_batch_size \(Prompts per step\)\?",
    ),
    (["trainer.algorithm.lr=1"], r"unknown config key 'trainer.algorithm.lr'"),
    (
        ["trainer.train_batch_size=abc"],
        r"trainer.train_batch_size='abc' does not fit the schema .*e.g. trainer.train_batch_size=16 "
        r"\(trainer.train_batch_size: Prompts per step\)",
    ),
    (["generator.step_wise=maybe"], r"generator.step_wise='maybe' does not fit the schema"),
    (["algorithm=dpo"], r"algorithm='dpo' is not a preset; choose one of \['grpo', 'ppo'"),
    (["environment=chess"], r"environment='chess' is not a preset"),
    (["trainer.train_batch_size=0"], r"trainer.train_batch_size=0 must be a positive integer"),
    (
        ["trainer.policy_mini_batch_size=5"],
        r"not divisible by trainer.policy_mini_batch_size=5.*e.g. trainer.policy_mini_batch_size=4",
    ),
    (
        ["trainer.policy_mini_batch_size=32"],
        r"policy_mini_batch_size=32 is larger than trainer.train_batch_size=16",
    ),
    (
        ["generator.step_wise=false", "trainer.micro_train_batch_size_per_gpu=3"],
        r"not divisible by trainer.micro_train_batch_size_per_gpu=3",
    ),
    (
        ["generator.n_samples_per_prompt=1"],
        r"advantage_estimator=grpo compares the samples .* use at least 2",
    ),
    (
        ["trainer.algorithm.advantage_estimator=vtrace"],
        r"trainer.algorithm.advantage_estimator='vtrace': unknown advantage estimator",
    ),
    (["trainer.algorithm.policy_loss=clip"], r"trainer.algorithm.policy_loss='clip': unknown policy loss"),
    (["trainer.algorithm.loss_reduction=mean"], r"loss_reduction='mean' is not one of \['token_mean'"),
    (["trainer.algorithm.loss_reduction=seq_mean_token_sum_norm"], r"needs trainer.algorithm.max_seq_len"),
    (["trainer.algorithm.kl_estimator=k4"], r"kl_estimator='k4' is not one of \['k1', 'k2', 'k3'\]"),
    (["trainer.algorithm.kl_ctrl.type=pid"], r"kl_ctrl.type='pid' is not 'fixed' or 'adaptive'"),
    (
        ["trainer.algorithm.dynamic_sampling=resample"],
        r"dynamic_sampling='resample' must be null or 'filter'",
    ),
    (["trainer.policy.optimizer.lr=0"], r"trainer.policy.optimizer.lr=0.0 must be positive"),
    (["trainer.policy.optimizer.scheduler=linear"], r"scheduler='linear' is not 'constant' or 'cosine'"),
    (
        ["trainer.resume_mode=/no/such/ckpt"],
        r"trainer.resume_mode='/no/such/ckpt' must be 'latest', 'none' or an existing",
    ),
    (["trainer.logger=[console,mlflow]"], r"unknown backends \['mlflow'\]; choose from"),
    (["generator.sampling.temperature=-1"], r"generator.sampling.temperature=-1.0 must be >= 0"),
    (["generator.sampling.top_p=0"], r"generator.sampling.top_p=0.0 must be in \(0, 1\]"),
    (
        ["generator.max_input_length=100", "data.max_prompt_length=200"],
        r"max_input_length=100 must exceed data.max_prompt_length=200",
    ),
    (
        ["environment.env_class=sokoban"],
        r"environment.env_class='sokoban': unknown environment 'sokoban'; registered: \[",
    ),
    (["data.train_path=/no/such/file.parquet"], r"data.train_path='/no/such/file.parquet' does not exist"),
    (["generator.inference_engine.backend=tgi"], r"backend='tgi' is not one of \['auto', 'vllm', 'hf'\]"),
    (["trainer.eval_interval=-1"], r"trainer.eval_interval=-1 must be >= 0"),
    (
        ["generator.inference_engine.tensor_parallel_size=2"],
        r"tensor_parallel_size=2 with trainer.placement.colocate_all=true.*or placement=disaggregated",
    ),
    (
        ["generator.inference_engine.num_engines=2"],
        r"num_engines=2 exceeds the 1 policy bundles .* use num_engines<=1 or placement=disaggregated",
    ),
    (
        ["generator.inference_engine.weight_sync=nccl"],
        r"weight_sync='nccl' is not one of \['auto', 'object_store', 'broadcast', 'ipc'\]",
    ),
    (
        ["placement=disaggregated", "generator.inference_engine.weight_sync=ipc"],
        r"weight_sync=ipc with trainer.placement.colocate_all=false.*use placement=colocated",
    ),
    (
        ["trainer.total_steps=-1"],
        r"trainer.total_steps=-1 must be >= 0, e.g. trainer.total_steps=100. trainer.total_steps: Training steps "
        r"\(batches\) of the run; 0 with `eval_before_train`: evaluate only.",
    ),
    (["trainer.max_tokens_per_micro_batch=0"], r"trainer.max_tokens_per_micro_batch=0 must be positive"),
    (
        ["trainer.algorithm.off_policy_correction=icepop"],
        r"off_policy_correction='icepop' is not one of \['none', 'tis', 'mis', 'seq_tis', 'seq_mis'\]",
    ),
    (["trainer.algorithm.mis_high=0.9"], r"need tis_cap > 0 and mis_low < 1 < mis_high"),
    (["trainer.logprob_chunk_tokens=0"], r"trainer.logprob_chunk_tokens=0 must be positive"),
    (
        ["trainer.policy.sequence_parallel_size=2"],
        r"trainer.policy.sequence_parallel_size=2 does not divide the 1 policy ranks "
        r"\(trainer.placement.policy_num_nodes x policy_num_gpus_per_node\); use one of \[1\]",
    ),
    (
        [
            "trainer.placement.policy_num_gpus_per_node=2",
            "trainer.policy.sequence_parallel_size=2",
            "trainer.policy.model.attn_implementation=eager",
        ],
        r"sequence_parallel_size=2 computes attention as sdpa or varlen .*model.attn_implementation='eager'; use sdpa or varlen",
    ),
    (
        [
            "trainer.placement.policy_num_gpus_per_node=2",
            "trainer.policy.sequence_parallel_size=2",
            "trainer.policy.model.compile=true",
        ],
        r"sequence_parallel_size=2 with trainer.policy.model.compile=true",
    ),
    (
        ["trainer.critic.model.attn_implementation=flash"],
        r"trainer.critic.model.attn_implementation='flash' is not one of \['sdpa', 'eager', 'flash_attention_2', 'varlen'\]",
    ),
    (
        ["environment.config.guess_number.allowed_tokens=[]"],
        r"environment.config.guess_number.allowed_tokens=\[\] must be a non-empty list",
    ),
    (["trainer.async_training.max_staleness=-1"], r"trainer.async_training.max_staleness=-1 must be >= 0"),
    (
        ["trainer.async_training.max_staleness=1"],
        r"max_staleness=1 generates while the workers train.*colocate_all=true; use placement=disaggregated",
    ),
    (
        ["generator.inflight_weight_updates=true"],
        r"inflight_weight_updates=true .*max_staleness=0 .*; set trainer.async_training.max_staleness=1",
    ),
    (
        ["generator.env_failure=skip"],
        r"generator.env_failure='skip' is not one of \['mask', 'zero_reward'\]",
    ),
    (
        ["generator.env_executor=ray"],
        r"generator.env_executor='ray' is not one of \['thread', 'process'\]",
    ),
    (["generator.env_workers=0"], r"generator.env_workers=0 must be positive"),
    (
        ["trainer.max_consecutive_skipped_steps=-1"],
        r"trainer.max_consecutive_skipped_steps=-1 must be >= 0",
    ),
    (["environment.timeout_s=0"], r"environment.timeout_s=0.0 must be > 0"),
    (["generator.max_engine_restarts=-1"], r"generator.max_engine_restarts=-1 must be >= 0"),
    (
        ["trainer.rpc_timeout_s=-5"],
        r"trainer.rpc_timeout_s=-5.0 must be > 0, e.g. trainer.rpc_timeout_s=1800. trainer.rpc_timeout_s: The "
        r"longest a call into the workers may take \(a step, a checkpoint\).",
    ),
    (["trainer.max_restarts=-1"], r"trainer.max_restarts=-1 must be >= 0"),
    (["trainer.preemption_grace_s=-1"], r"trainer.preemption_grace_s=-1.0 must be >= 0"),
    (["generator.agent=my_agent"], r"generator.agent='my_agent' must be 'package.module:name'"),
    (
        ["generator.agent=no_such_module:run"],
        r"generator.agent='no_such_module:run': cannot import module 'no_such_module'",
    ),
    (
        ["generator.agent=tests.train.generator.user_agents:missing"],
        r"module 'tests.train.generator.user_agents' has no attribute 'missing'",
    ),
    (
        ["generator.agent=tests.train.generator.user_agents:not_a_function"],
        r"generator.agent='tests.train.generator.user_agents:not_a_function' is 3, not a function",
    ),
    (
        [f"generator.agent={AGENT}", "generator.agent_timeout_s=0"],
        r"generator.agent_timeout_s=0.0 must be > 0",
    ),
    (
        [
            f"generator.agent={AGENT}",
            "generator.step_wise=false",
            "trainer.micro_train_batch_size_per_gpu=32",
        ],
        r"generator.agent=.* with generator.step_wise=false: .* set generator.step_wise=true",
    ),
    (
        [
            f"generator.agent={AGENT}",
            "generator.generator_class=tests.train.generator.user_generators:OneTurn",
        ],
        r"generator.agent=.* and generator.generator_class=.* both name who runs the episodes",
    ),
    (
        ["generator.generator_class=tests.train.generator.user_agents:chatty"],
        r"generator.generator_class=.* is <function chatty .*>, not a class with `async def agenerate",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_CONFIGS, ids=[" ".join(o) for o, _ in BAD_CONFIGS])
def test_each_bad_config_gets_one_readable_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_config(overrides)


def test_cli_prints_the_error_without_a_traceback_and_leaves_no_run_directory(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "skyrl.train", "trainer.policy_mini_batch_size=5"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 1
    assert result.stderr.strip().startswith("config error: trainer.train_batch_size=16 is not divisible")
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_cli_prints_the_resolved_config():
    result = subprocess.run(
        [sys.executable, "-m", "skyrl.train", "--cfg", "job", "algorithm=ppo"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "advantage_estimator: gae" in result.stdout


# A second driver: compose the config like `python -m skyrl.train`, call its start_ray, report what it joined.
JOIN_SCRIPT = """
import json, sys
import ray
from skyrl.train.__main__ import start_ray
from skyrl.train.config import compose_config

name, namespace, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
start_ray(compose_config(overrides))
holder = ray.get_actor(name, namespace=namespace)
print(json.dumps({
    "gcs_address": ray.get_runtime_context().gcs_address,
    "node_id": ray.get_runtime_context().get_node_id(),
    "cpus": ray.cluster_resources().get("CPU"),
    "token": ray.get(holder.token.remote()),
}))
"""


def test_start_ray_joins_the_running_cluster(ray_cluster):
    """Separate drivers given the session cluster's address (the config key, the env var; both at once)
    join that cluster: same GCS address, node and CPUs, and each reaches a named actor created here."""
    ray = ray_cluster

    class TokenHolder:
        def __init__(self, token: str):
            self._token = token

        def token(self) -> str:
            return self._token

    address = ray.get_runtime_context().gcs_address
    name, namespace, token = f"token-{uuid.uuid4().hex[:8]}", "skyrl-test-join", uuid.uuid4().hex
    holder = ray.remote(num_cpus=0)(TokenHolder).options(name=name, namespace=namespace).remote(token)
    assert ray.get(holder.token.remote()) == token
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    drivers = {
        via: subprocess.Popen(
            [sys.executable, "-c", JOIN_SCRIPT, name, namespace, *overrides],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=driver_env,
        )
        for via, overrides, driver_env in [
            ("ray.address", [f"ray.address={address}"], env),
            ("RAY_ADDRESS", [], {**env, "RAY_ADDRESS": address}),
        ]
    }
    try:
        outputs = {via: driver.communicate(timeout=120) for via, driver in drivers.items()}
    finally:
        for driver in drivers.values():
            driver.kill()
        ray.kill(holder)
    for via, (stdout, stderr) in outputs.items():
        assert drivers[via].returncode == 0, f"{via}: {stderr[-3000:]}"
        joined = json.loads(stdout.strip().splitlines()[-1])
        assert joined == {
            "gcs_address": address,
            "node_id": ray.get_runtime_context().get_node_id(),
            "cpus": ray.cluster_resources()["CPU"],
            "token": token,
        }, via


# A driver that starts its own local cluster and an actor at work, then waits to be killed.
LOCAL_DRIVER_SCRIPT = """
import json, os, time
import psutil, ray
from skyrl.train.__main__ import start_ray
from skyrl.train.config import compose_config

start_ray(compose_config(["ray.num_cpus=1"]))
worker = ray.remote(num_cpus=1)(lambda: time.sleep(300)).remote()
time.sleep(3)  # the actor's worker process is up
me = psutil.Process()
print(json.dumps([(p.pid, p.create_time()) for p in me.children(recursive=True)]), flush=True)
time.sleep(300)
"""


def test_a_local_cluster_goes_away_with_its_driver_after_sigkill():
    """SIGKILL of the driver (an OOM kill) leaves none of the processes of the cluster it started:
    GCS, raylet, dashboard and runtime-env agents, workers."""
    import psutil

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = subprocess.Popen(
        [sys.executable, "-c", LOCAL_DRIVER_SCRIPT], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        started = [tuple(p) for p in json.loads(driver.stdout.readline())]
    finally:
        driver.kill()
        driver.wait()
    assert any("raylet" in psutil.Process(pid).name() for pid, _ in started if psutil.pid_exists(pid))

    def alive() -> list[str]:
        found = []
        for pid, created in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                process = psutil.Process(pid)
                if process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(" ".join(process.cmdline())[:80])
        return found

    deadline = time.monotonic() + 30
    while alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive()


def test_a_failed_run_prints_one_paragraph_with_the_command_that_reruns_it(ray_cluster, tmp_path):
    address = ray_cluster.get_runtime_context().gcs_address  # joined: Ray's own start is not the subject
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        json.dumps({"prompt": "2 + 2?", "answer": "4"}) + "\n" + json.dumps({"answer": "5"}) + "\n"
    )
    run_dir = tmp_path / "run"
    args = [
        "environment=math",
        f"data.train_path={data}",
        f"ray.address={address}",
        f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "skyrl.train", *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 1
    assert (
        "training stopped: ValueError:" in result.stderr
        and "row 2 of 2 has no 'prompt' column" in result.stderr
    )
    assert "Traceback" not in result.stderr
    assert f"Full traceback: {run_dir / 'error.log'}" in result.stderr
    traceback = (run_dir / "error.log").read_text()
    assert "Traceback" in traceback
    assert "in load_inputs" in traceback and "in train" not in traceback  # read before the trainer starts
    assert "No checkpoint was written" in result.stderr and f"hydra.run.dir={run_dir}" in result.stderr


def test_failure_report_names_the_checkpoint_a_rerun_resumes_from(tmp_path):
    from skyrl.train.__main__ import failure_report

    (tmp_path / "checkpoints" / "global_step_4").mkdir(parents=True)
    (tmp_path / "checkpoints" / "global_step_4" / "COMPLETE").touch()
    report = failure_report(compose_config([]), tmp_path, KeyboardInterrupt(), ["trainer.total_steps=9"])
    assert report.startswith("training stopped: interrupted (Ctrl-C)")
    assert "Resume from global_step_4 with:" in report
    assert report.endswith(f"-m skyrl.train trainer.total_steps=9 hydra.run.dir={tmp_path}")


def test_failure_report_of_a_dead_engine_resumes_without_the_resume_mode_that_would_refuse(tmp_path):
    from skyrl.train.__main__ import failure_report
    from skyrl.train.inference.client import EngineDeadError

    (tmp_path / "checkpoints" / "global_step_2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "global_step_2" / "COMPLETE").touch()
    error = EngineDeadError("inference engine 0 is dead.\nRay reports: ...\n`await client.restart_engine(0)`")
    argv = ["trainer.resume_mode=none", "trainer.total_steps=9"]
    report = failure_report(compose_config([]), tmp_path, error, argv)
    assert report.startswith("training stopped: EngineDeadError: inference engine 0 is dead.\n")
    assert "restart_engine" not in report  # API advice a CLI user cannot follow
    assert report.endswith(f"-m skyrl.train trainer.total_steps=9 hydra.run.dir={tmp_path}")


def test_summary_reports_the_first_step_of_the_whole_run_after_a_resume(tmp_path):
    from skyrl.train.__main__ import summary

    records = [{"step": s, "reward/mean": s / 10} for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    resumed_history = records[2:]  # this process ran steps 3 and 4
    line = summary(compose_config(["trainer.logger=[jsonl]"]), tmp_path, resumed_history)
    assert line.startswith("first-step mean reward 0.100, final mean reward (last 1 steps) 0.400")
