"""Run every training command that README.md and docs/*.md show in their bash blocks, as written, with
a tiny step count: each `python -m skyrl.train ...` gets `trainer.total_steps=1` (no checkpoints, no
evaluation) and a run directory of its own, and must exit 0. Commands that cannot run on this machine
are listed with the reason and skipped: a model from the Hugging Face hub (no network), a cluster to
join (RAY_ADDRESS), the test command (CI runs it itself); the install step before a command is
dropped (CI has installed). Commands in the prose (inline
code, e.g. the benchmarks) are not run.

Usage: python scripts/check_docs_commands.py [--list]   (--list: what would run, and what not, and why)
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from skyrl.train.config import compose_config

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.DOTALL)
BUILT_HERE = ("tiny", "tiny-tools")  # models `resolve_model_path` builds locally
TINY = [
    "trainer.total_steps=1",
    "trainer.ckpt_interval=0",
    "trainer.eval_interval=0",
    "trainer.eval_before_train=false",
]


def commands() -> list[tuple[str, str]]:
    """(where, command) for each command of each bash block: continuation lines joined, comments and the
    install step (`bash scripts/install.sh ... && `) dropped."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in BLOCK.findall(path.read_text()):
            for command in block.replace("\\\n", " ").splitlines():
                for part in command.split(" #")[0].split(" && "):  # CI has installed: the rest runs
                    part = part.strip()
                    if part and not part.startswith(("#", "bash scripts/install.sh")):
                        found.append((str(path.relative_to(ROOT)), part))
    return found


def why_not(command: str) -> str | None:
    """Why `command` cannot run here, or None."""
    words = shlex.split(command)
    if "skyrl.train" not in words:
        return "not a training command (the tests)"
    if any(re.fullmatch(r"[A-Z_]+=.*", w) for w in words):
        return "joins a cluster (RAY_ADDRESS)"
    args = words[words.index("skyrl.train") + 1 :]
    if "--cfg" in args:
        return None
    config_dir = ROOT / args[args.index("--config-dir") + 1] if "--config-dir" in args else None
    name = args[args.index("--config-name") + 1] if "--config-name" in args else "config"
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    # not validated: a recipe's data files need not be here for us to read its model
    model = compose_config(overrides, config_dir, name, validate=False).trainer.policy.model.path
    if model not in BUILT_HERE and not (ROOT / model).exists():
        return f"needs the hub model {model}"
    return None


def run(command: str, run_dir: Path) -> tuple[int, float, str]:
    """Exit code, seconds and output tail of `command` (from the repository root) with a tiny step count."""
    words = shlex.split(command)
    if "--cfg" not in words:
        words += [*TINY, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    done = subprocess.run(words, cwd=ROOT, capture_output=True, text=True, timeout=900)
    return done.returncode, time.perf_counter() - start, (done.stdout + done.stderr)[-3000:]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--list", action="store_true", help="list what would run and what not, and why")
    args = parser.parse_args()
    plan: dict[str, tuple[str, str | None]] = {}  # each distinct command once, where it first appears
    for where, command in commands():
        plan.setdefault(command, (where, why_not(command)))
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (command, (where, reason)) in enumerate(plan.items()):
            if reason or args.list:
                print(
                    f"{'skip' if reason else 'run '} {where}: {command}" + (f"  ({reason})" if reason else "")
                )
                continue
            code, seconds, tail = run(command, Path(tmp) / f"run{i}")
            print(f"{'ok  ' if code == 0 else 'FAIL'} {where}: {command}  ({seconds:.0f} s)", flush=True)
            if code:
                failed.append(command)
                print(tail)
    ran = sum(reason is None for _, reason in plan.values())
    print(f"docs commands: {ran} {'would run' if args.list else f'ran, {len(failed)} failed'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
