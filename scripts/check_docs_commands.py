"""Run every command that README.md and docs/*.md show, as written, at a tiny size.

Commands come from the bash blocks and from the prose's inline code that starts a training run
(`python -m skyrl.train ...`) or a script (`scripts/NAME.py ...`):
- each training command gets `trainer.total_steps=1` (no checkpoints, no evaluation) and a run
  directory of its own;
- each script gets its `SMOKE` arguments (small sizes, one step) after the ones the docs show; a usage
  line runs once per form (`[--engine hf|vllm]`: without the flag, with hf, with vllm), and `RUN_DIR`
  is the run directory of a training command that ran before it;
- every command must exit 0; a script the docs name without `SMOKE` arguments, or an entry of `SMOKE`
  or `COVERED` for a script the docs do not name, fails the check.

What cannot run on this machine is listed with the reason and skipped: a model from the Hugging Face
hub (no network), a cluster to join (RAY_ADDRESS), a template (`--config-name NAME`), the tests and
lint (CI runs them itself), the scripts of `COVERED` (run elsewhere); the install step before a
command is dropped (CI has installed).

Usage: python scripts/check_docs_commands.py [--list]   (--list: what would run, and what not, and why)
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from skyrl.train.cluster import LOCAL_MODELS
from skyrl.train.config import compose_config

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.DOTALL)
FENCE = re.compile(r"```.*?```", re.DOTALL)
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
STARTS = re.compile(r"(?:[A-Z_]+=\S+ )*(?:\S*python3? )?(?:-m skyrl\.train|scripts/[a-z_]+\.py)(?: |$)")
SCRIPT = re.compile(r"scripts/([a-z_]+)\.py")
INTERPRETER = re.compile(r"(?:\S*/)?python3?")
TINY = [
    "trainer.total_steps=1",
    "trainer.ckpt_interval=0",
    "trainer.eval_interval=0",
    "trainer.eval_before_train=false",
]
SMOKE = {  # each script's arguments for a run in seconds, after the arguments the docs show
    "bench_agent": "--prompts 2 --samples 2 --repeats 1",
    "bench_async": "--steps 2 --warmup 0 --staleness 0 1",
    "bench_data_plane": "--sequences 2000 --lengths 1000 --trials 2",
    "bench_generate": "--prompts 4 --max-tokens 8 --repeats 1",
    "bench_reward": "--texts 8 --min-len 8 --max-len 32 --hidden 64 --layers 2 --repeats 1",
    "bench_step": "--steps 1 --warmup 0",
    # hidden 128: two attention heads, which `--sp 2` splits
    "bench_train": "--hidden 128 --layers 2 --sequences 4 --length 64 --trajectories 2 --turns 2 --system 20 --steps 1",
    "bench_weight_sync": "--hidden 64 --layers 2 --repeats 1",
    "chaos": "--kills 1 --steps 3 --ckpt-interval 1",
    "check_dp_equivalence": "",
    "plot_metrics": "",
}
COVERED = {  # scripts the docs name that run elsewhere
    "check_docs_commands": "this check",
    "config_reference": "tests/test_docs.py runs it with --check",
    "gpu_check": "tests/scripts/test_gpu_check.py runs it with --tiny; the rest needs a GPU",
    "suite_budget": ".ci/run runs it on the suite's JUnit XML",
}


def commands() -> list[tuple[str, str]]:
    """(where, command) for each command of each bash block (continuation lines joined, comments and
    the install step `bash scripts/install.sh ... && ` dropped) and of each inline code span that
    starts a training run or a script, whitespace collapsed."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text, where = path.read_text(), str(path.relative_to(ROOT))
        for block in BLOCK.findall(text):
            for command in block.replace("\\\n", " ").splitlines():
                for part in command.split(" #")[0].split(" && "):  # CI has installed: the rest runs
                    part = " ".join(part.split())
                    if part and not part.startswith(("#", "bash scripts/install.sh")):
                        found.append((where, part))
        for span in INLINE.findall(FENCE.sub("", text)):
            span = " ".join(span.split())
            if STARTS.match(span):
                found.append((where, span))
    return found


def forms(command: str) -> list[str]:
    """The concrete commands a usage line stands for: `[...]` without and with, `a|b` each."""
    optional = re.search(r"\[([^\[\]]*)\]", command)
    if optional:
        head, tail = command[: optional.start()], command[optional.end() :]
        return [
            f for inner in ("", optional.group(1)) for f in forms(" ".join(f"{head}{inner}{tail}".split()))
        ]
    choice = re.search(r"\S*\|\S*", command)
    if choice:
        head, tail = command[: choice.start()], command[choice.end() :]
        return [f for option in choice.group().split("|") for f in forms(f"{head}{option}{tail}")]
    return [command]


def without_interpreter(words: list[str]) -> list[str]:
    return words[1:] if INTERPRETER.fullmatch(words[0]) else words


def key(command: str) -> str:
    """`command` without its interpreter: `python scripts/x.py` and `scripts/x.py` are one command."""
    return " ".join(without_interpreter(command.split()))


def why_not(command: str) -> str | None:
    """Why `command` cannot run here, or None."""
    words = shlex.split(command)
    if "RAY_ADDRESS" in (w.split("=")[0] for w in words):
        return "joins a cluster (RAY_ADDRESS)"
    if "NAME" in words:
        return "a template: NAME stands for a recipe, whose own command is listed here"
    script = SCRIPT.search(command)
    if script:
        return COVERED.get(script.group(1))
    if "skyrl.train" not in words:
        return "not a training command or a script: CI runs the tests and lint itself"
    args = words[words.index("skyrl.train") + 1 :]
    if "--cfg" in args:
        return None
    config_dir = ROOT / args[args.index("--config-dir") + 1] if "--config-dir" in args else None
    name = args[args.index("--config-name") + 1] if "--config-name" in args else "config"
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    # not validated: a recipe's data files need not be here for us to read its model
    model = compose_config(overrides, config_dir, name, validate=False).trainer.policy.model.path
    if model not in LOCAL_MODELS and not (ROOT / model).exists():
        return f"needs the hub model {model}"
    return None


def argv(command: str, run_dir: Path, last_run: Path | None) -> tuple[list[str], dict[str, str]]:
    """The words to run for `command` (this interpreter, the tiny size) and the environment it sets."""
    env = dict(os.environ)
    words = shlex.split(command)
    while "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    words = [sys.executable, *without_interpreter(words)]
    script = SCRIPT.search(command)
    if script:
        if "RUN_DIR" in words:
            if last_run is None:
                raise RuntimeError(f"{command}: no training command ran before it to give it a RUN_DIR")
            words[words.index("RUN_DIR")] = str(last_run)
        return words + SMOKE[script.group(1)].split(), env
    if "--cfg" not in words:
        words += [*TINY, f"hydra.run.dir={run_dir}"]
    return words, env


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--list", action="store_true", help="list what would run and what not, and why")
    args = parser.parse_args()
    plan: dict[str, tuple[str, str, str | None]] = {}  # each distinct command once, where it first appears
    for where, usage in commands():
        reason = why_not(usage)
        for command in [usage] if reason else forms(usage):
            if key(command) not in plan:
                plan[key(command)] = (where, command, reason)
    # training commands first: their run directories are the RUN_DIR of the scripts that read one
    order = sorted(plan.values(), key=lambda entry: SCRIPT.search(entry[1]) is not None)
    # the tables and the docs name the same scripts: none runs without SMOKE arguments, no entry is stale
    shown = {m.group(1) for _, command, _ in order if (m := SCRIPT.search(command))}
    mismatched = sorted(shown ^ (SMOKE.keys() | COVERED.keys()))
    for script in mismatched:
        side = "has no SMOKE or COVERED entry" if script in shown else "has an entry, but the docs show none"
        print(f"FAIL scripts/{script}.py {side}")
    if mismatched:
        sys.exit(1)
    failed, last_run = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for i, (where, command, reason) in enumerate(order):
            if reason or args.list:
                print(
                    f"{'skip' if reason else 'run '} {where}: {command}" + (f"  ({reason})" if reason else "")
                )
                continue
            run_dir = Path(tmp) / f"run{i}"
            words, env = argv(command, run_dir, last_run)
            start = time.perf_counter()
            done = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            seconds = time.perf_counter() - start
            print(
                f"{'ok  ' if done.returncode == 0 else 'FAIL'} {where}: {command}  ({seconds:.0f} s)",
                flush=True,
            )
            if done.returncode:
                failed.append(command)
                print((done.stdout + done.stderr)[-3000:])
            elif run_dir.exists():
                last_run = run_dir
    ran = sum(reason is None for _, _, reason in plan.values())
    print(f"docs commands: {ran} {'would run' if args.list else f'ran, {len(failed)} failed'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
