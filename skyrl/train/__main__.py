"""`python -m skyrl.train [key=value ...]`: compose the config, validate it, start or join Ray, train.

With no overrides it trains the tiny default model on `guess_number` on this
machine's CPU. The Hydra output directory is the run directory: resolved config,
metrics.jsonl, TensorBoard logs, checkpoints, exported models, reward plot.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from skyrl.train.config import CONFIG_DIR, register_schema, validate_config
from skyrl.train.overrides import check_overrides
from skyrl.train.schema import SkyRLConfig
from skyrl.train.utils.errors import ConfigError

register_schema()


def start_ray(cfg: SkyRLConfig) -> None:
    """Join `ray.address` (or RAY_ADDRESS) when given, else start a local cluster."""
    import ray

    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level="warning")
    else:
        num_cpus = cfg.ray.num_cpus or max(4, os.cpu_count() or 1)
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="warning")


def train(cfg: SkyRLConfig, run_dir: Path) -> list[dict[str, float]]:
    """Build the trainer in `run_dir`, resume if asked, train, and summarise the run."""
    from transformers import AutoTokenizer

    from skyrl.train.trainer import Trainer, load_datasets, resolve_model_path
    from skyrl.train.utils.plotting import plot_metrics

    model_path = resolve_model_path(cfg.trainer.policy.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    trainer = Trainer(cfg, run_dir, model_path, load_datasets(cfg, tokenizer))
    try:
        history = trainer.fit()
    finally:
        trainer.shutdown()
    if history:
        rewards = [m["reward/mean"] for m in history]
        tail = rewards[-max(1, len(rewards) // 10) :]
        print(
            f"first-step mean reward {rewards[0]:.3f}, final mean reward (last {len(tail)} steps) "
            f"{sum(tail) / len(tail):.3f}; run directory {run_dir}"
        )
    if "jsonl" in cfg.trainer.logger:
        print(f"reward plot: {plot_metrics(run_dir)}")
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
    start_ray(cfg)
    train(cfg, run_dir)


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


if __name__ == "__main__":
    try:
        check_overrides(sys.argv[1:], CONFIG_DIR)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    main()
