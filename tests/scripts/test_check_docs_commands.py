"""scripts/check_docs_commands.py reads the docs' commands as a reader does: usage lines stand for each of
their forms, and what cannot run here is skipped with the reason (CI runs the script itself)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "check_docs_commands", ROOT / "scripts" / "check_docs_commands.py"
)
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


def test_a_usage_line_runs_once_per_form():
    assert check.forms("scripts/bench_step.py --engine hf|vllm") == [
        "scripts/bench_step.py --engine hf",
        "scripts/bench_step.py --engine vllm",
    ]
    assert check.forms("scripts/gpu_check.py [--compile] [--n 2]") == [
        "scripts/gpu_check.py",
        "scripts/gpu_check.py --n 2",
        "scripts/gpu_check.py --compile",
        "scripts/gpu_check.py --compile --n 2",
    ]
    assert check.key(".venv/bin/python scripts/x.py --a 1") == check.key("scripts/x.py --a 1")


def test_what_cannot_run_here_is_skipped_with_its_reason():
    assert "RAY_ADDRESS" in check.why_not("RAY_ADDRESS=h:6379 .venv/bin/python -m skyrl.train")
    assert "template" in check.why_not(
        ".venv/bin/python -m skyrl.train --config-dir configs --config-name NAME"
    )
    assert "hub model" in check.why_not("python -m skyrl.train trainer.policy.model.path=Qwen/Qwen2.5-0.5B")
    assert "test_gpu_check" in check.why_not("PYTHONPATH=. python3 scripts/gpu_check.py --profile")
    assert check.why_not("python -m skyrl.train trainer.seed=1") is None
    assert check.why_not("scripts/bench_train.py --sp 2") is None


def test_the_docs_show_a_command_for_every_script_the_check_knows():
    shown = {m.group(1) for _, command in check.commands() if (m := check.SCRIPT.search(command))}
    assert shown == check.SMOKE.keys() | check.COVERED.keys()
