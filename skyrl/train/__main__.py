"""`python -m skyrl.train [key=value ...]`: compose the config, validate it, read the model path and the datasets,
start or join Ray, train.

With no overrides it trains the tiny default model on `guess_number` on this
machine's CPU. The Hydra output directory is the run directory: resolved config,
metrics.jsonl, TensorBoard logs, checkpoints, exported models, reward plot.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from skyrl.train.config import CONFIG_DIR, register_schema, validate_config
from skyrl.train.overrides import check_config_name, check_overrides
from skyrl.train.schema import SkyRLConfig
from skyrl.train.utils.errors import ConfigError
from skyrl.train.utils.preemption import Preempted

if TYPE_CHECKING:
    from skyrl.train.dataset.prompt_dataset import PromptDataset

    Datasets = tuple[PromptDataset, PromptDataset | None]

HTTP_CLIENT_LOGGERS = ("httpx", "httpx2", "httpcore")
T = TypeVar("T")

register_schema()


def start_ray(cfg: SkyRLConfig) -> None:
    """Join `ray.address` (or RAY_ADDRESS) when given, else start a local cluster that ends with this
    process however it ends (`utils.reaper`)."""
    import ray

    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level="warning")
    else:
        from skyrl.train.utils.reaper import reap_descendants_on_exit

        num_cpus = cfg.ray.num_cpus or max(4, os.cpu_count() or 1)
        ray.init(num_cpus=num_cpus, include_dashboard=cfg.ray.include_dashboard, logging_level="warning")
        reap_descendants_on_exit()  # the local cluster goes with this process, even after SIGKILL


def summary(cfg: SkyRLConfig, run_dir: Path, history: list[dict[str, float]]) -> str:
    """First-step and final mean reward of the whole run (resumed parts included, from metrics.jsonl),
    or of this process's steps when no JSONL log is kept."""
    from skyrl.train.utils.tracking import read_metrics

    if "jsonl" in cfg.trainer.logger:
        steps = [r for r in read_metrics(run_dir) if "reward/mean" in r]
        first = "first-step"
    else:
        steps = history
        first = "first-step (of this process)"
    if not steps:
        return f"no training step ran; run directory {run_dir}"
    rewards = [m["reward/mean"] for m in steps]
    tail = rewards[-max(1, len(rewards) // 10) :]
    return (
        f"{first} mean reward {rewards[0]:.3f}, final mean reward (last {len(tail)} steps) "
        f"{sum(tail) / len(tail):.3f}; run directory {run_dir}"
    )


def load_inputs(cfg: SkyRLConfig) -> tuple[str, Datasets]:
    """The policy's model path and the (train, eval) datasets, read before the trainer starts: a wrong model
    path or a bad dataset row stops the run in seconds."""
    from transformers import AutoTokenizer

    from skyrl.train.cluster import resolve_model_path
    from skyrl.train.sampler import load_datasets

    model_path = resolve_model_path(cfg.trainer.policy.model.path)
    return model_path, load_datasets(cfg, AutoTokenizer.from_pretrained(model_path))


def train(cfg: SkyRLConfig, run_dir: Path, model_path: str, datasets: Datasets) -> list[dict[str, float]]:
    """Build the trainer in `run_dir`, resume if asked, train, and summarise the run."""
    from skyrl.train.trainer import Trainer
    from skyrl.train.utils.daemon_pool import abandoned_report
    from skyrl.train.utils.plotting import plot_metrics

    trainer = Trainer(cfg, run_dir, model_path, datasets)
    try:
        history = trainer.fit(stop_on_signals=True)
    finally:
        trainer.shutdown()
        if (report := abandoned_report()) is not None:
            logging.getLogger(__name__).warning(report)
    print(summary(cfg, run_dir, history))
    if "jsonl" in cfg.trainer.logger:
        print(f"reward plot: {plot_metrics(run_dir)}")
    if trainer.preempted is not None:
        name = signal.Signals(trainer.preempted).name
        raise Preempted(f"{name}: stopped after step {trainer.step} with its checkpoint", trainer.preempted)
    return history


@hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="config")
def main(dict_cfg: DictConfig) -> None:
    cfg: SkyRLConfig = OmegaConf.to_object(dict_cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        validate_config(cfg)
    except ConfigError as e:
        _remove_unused_run_dir(run_dir)
        sys.exit(f"config error: {e}")
    # an agent's HTTP client logs every request at INFO; the run's console keeps its own lines
    for name in HTTP_CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    # the inputs are read (imports of seconds, the datasets) while Ray starts its processes
    with ThreadPoolExecutor(max_workers=1) as pool:
        inputs = pool.submit(load_inputs, cfg)
        start_ray(cfg)
        model_path, datasets = _or_report(cfg, run_dir, inputs.result)
    _or_report(cfg, run_dir, lambda: train(cfg, run_dir, model_path, datasets))


def _or_report(cfg: SkyRLConfig, run_dir: Path, call: Callable[[], T]) -> T:
    """`call()`; on an error, exit with its one-paragraph report (`failure_report`)."""
    try:
        return call()
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    except (Exception, KeyboardInterrupt) as e:
        report = failure_report(cfg, run_dir, e, sys.argv[1:])
        if isinstance(e, Preempted):  # a scheduler's SIGTERM: its conventional exit code
            print(report, file=sys.stderr)
            sys.exit(128 + e.signum)
        sys.exit(report)


def failure_report(cfg: SkyRLConfig, run_dir: Path, error: BaseException, argv: list[str]) -> str:
    """One paragraph for the console: what stopped the run, where its traceback is (`error.log` in the
    run directory, written here) and the command that resumes it (or reruns it without a checkpoint)."""
    from skyrl.train.checkpoints import latest_checkpoint

    log = run_dir / "error.log"
    log.write_text("".join(traceback.format_exception(error)))
    if isinstance(error, Preempted):
        what = f"pre-empted ({error})"
    elif isinstance(error, KeyboardInterrupt):
        what = "interrupted (Ctrl-C)"
    else:
        message = str(error).strip().splitlines()
        what = f"{type(error).__name__}: {message[0] if message else ''}"
    # the resume command continues this directory: another run dir or resume mode would not
    args = [a for a in argv if not a.startswith(("hydra.run.dir=", "trainer.resume_mode="))]
    command = shlex.join([sys.executable, "-m", "skyrl.train", *args, f"hydra.run.dir={run_dir}"])
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    if checkpoint is not None:
        resume = f"Resume from {checkpoint.name} with:\n  {command}"
    else:
        resume = (
            f"No checkpoint was written (trainer.ckpt_interval={cfg.trainer.ckpt_interval}); this command "
            f"starts it over:\n  {command}"
        )
    return f"training stopped: {what}\nFull traceback: {log}\n{resume}"


def _remove_unused_run_dir(run_dir: Path) -> None:
    """Delete the run directory Hydra made for a run that never started (it holds only `.hydra` and its log),
    and the directories above it that this leaves empty (`outputs/DATE`), up to the working directory."""
    if {p.name for p in run_dir.iterdir()} - {".hydra", "__main__.log"}:
        return
    shutil.rmtree(run_dir)
    for parent in run_dir.parents:
        if parent == Path.cwd() or any(parent.iterdir()):
            break
        parent.rmdir()


def check_command_line(argv: list[str]) -> None:
    """Check `--config-name` (a recipe in `--config-dir`, or the package's `config`) and the `key=value`
    overrides before Hydra composes them; Hydra reports malformed flags itself."""
    import contextlib
    import io

    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = get_args_parser().parse_args(argv)
    except SystemExit:
        return
    recipes = Path(args.config_dir) if args.config_dir else None
    if args.config_path is None:  # --config-path moves the primary folder: Hydra checks that one itself
        check_config_name(args.config_name or "config", recipes, CONFIG_DIR)
    check_overrides(args.overrides, CONFIG_DIR, *([recipes] if recipes else []))


if __name__ == "__main__":
    try:
        check_command_line(sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    main()
