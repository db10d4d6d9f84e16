"""The runnable recipes in the repository's `configs/`: each composes and validates (nothing runs).

`python -m skyrl.train --config-dir configs --config-name NAME` composes the recipe NAME over the
package's tree; `compose_config(overrides, config_dir, NAME)` does the same in Python.
"""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from skyrl.train.config import CONFIG_DIR, check_gpu_budget, compose_config, register_schema
from skyrl.train.utils.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "configs"
NAMES = sorted(p.stem for p in RECIPES.glob("*.yaml"))


def _data_paths(name: str) -> list[str]:
    """The data files recipe `name` reads, from its composed (not yet validated) config."""
    register_schema()
    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        cfg = compose(name, overrides=[f"hydra.searchpath=['file://{CONFIG_DIR}']"])
    return [p for p in (cfg.data.train_path, cfg.data.eval_path) if p]


@pytest.fixture
def in_run_dir(tmp_path, monkeypatch):
    """Start from an empty directory, as a user starts a run from the repository root."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_recipes_are_there():
    assert {"cpu_default", "gsm8k_qwen0.5b_1node", "gsm8k_qwen0.5b_2nodes"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_recipe_composes_and_validates(name, in_run_dir):
    # Validation checks that data files exist (their rows are read at run time): the recipe names
    # them relative to where the run starts, and the test puts empty ones there.
    for path in _data_paths(name):
        assert not Path(path).is_absolute(), (
            f"{name}: data path {path} should be relative to the run directory"
        )
        (in_run_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (in_run_dir / path).touch()
    cfg = compose_config([], RECIPES, name)
    assert cfg.trainer.total_steps > 0


def test_cpu_default_is_the_default_job():
    assert compose_config([], RECIPES, "cpu_default") == compose_config([])


def _gsm8k_data(root: Path) -> None:
    (root / "data/gsm8k").mkdir(parents=True)
    for name in ("train", "test"):
        (root / f"data/gsm8k/{name}.parquet").touch()


def test_gsm8k_recipe_is_the_examples_setup(in_run_dir):
    _gsm8k_data(in_run_dir)
    cfg = compose_config([], RECIPES, "gsm8k_qwen0.5b_1node")
    assert cfg.environment.env_class == "math" and not cfg.generator.step_wise
    assert cfg.trainer.policy.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg.generator.inference_engine.backend == "vllm"
    p = cfg.trainer.placement
    assert (p.policy_num_nodes, p.policy_num_gpus_per_node, p.colocate_all) == (1, 8, True)


def test_the_judge_recipe_splits_the_node_between_the_policy_and_its_judge(in_run_dir):
    _gsm8k_data(in_run_dir)
    cfg = compose_config([], RECIPES, "gsm8k_llm_judge")
    judge = cfg.reward.sources["judge"]
    assert (judge["type"], judge["model"], cfg.reward.sources["env"]["weight"]) == (
        "judge",
        "Qwen/Qwen2.5-7B-Instruct",
        1.0,
    )
    check_gpu_budget(cfg, use_ref=False, use_critic=False, cluster_gpus=8)  # 4 policy + 2 x 2 judge GPUs
    with pytest.raises(ConfigError, match=r"needs 8 GPUs .*judge judge engines 4\), the Ray cluster has 7"):
        check_gpu_budget(cfg, use_ref=False, use_critic=False, cluster_gpus=7)


def test_the_rlhf_recipe_is_classic_ppo_on_a_reward_model_alone(in_run_dir):
    (in_run_dir / "data/rlhf").mkdir(parents=True)
    for name in ("train", "test"):
        (in_run_dir / f"data/rlhf/{name}.parquet").touch()
    cfg = compose_config([], RECIPES, "rlhf_ppo_qwen0.5b")
    algorithm, sources = cfg.trainer.algorithm, cfg.reward.sources
    assert (algorithm.advantage_estimator, algorithm.use_kl_in_reward, cfg.environment.env_class) == (
        "gae",
        True,
        "chat",
    )
    assert sources["env"]["weight"] == 0.0 and sources["rm"]["type"] == "model"
    check_gpu_budget(cfg, use_ref=True, use_critic=True, cluster_gpus=8)  # all colocated on the policy's 8


def test_the_long_context_recipe_splits_each_sequence_over_4_ranks(in_run_dir):
    from skyrl.train.config import batch_sizes

    cfg = compose_config([], RECIPES, "long_context_qwen7b_sp4")
    trainer = cfg.trainer
    assert (trainer.policy.sequence_parallel_size, batch_sizes(cfg).policy_dp_size) == (4, 2)
    assert trainer.max_tokens_per_micro_batch == cfg.generator.max_input_length == 32768  # an episode fits
    check_gpu_budget(cfg, use_ref=False, use_critic=False, cluster_gpus=8)


def test_two_nodes_is_the_one_node_recipe_on_twice_the_gpus(in_run_dir):
    _gsm8k_data(in_run_dir)
    one = compose_config([], RECIPES, "gsm8k_qwen0.5b_1node")
    two = compose_config([], RECIPES, "gsm8k_qwen0.5b_2nodes")
    assert (two.trainer.placement.policy_num_nodes, two.generator.inference_engine.num_engines) == (2, 16)
    one.trainer.placement.policy_num_nodes = 2
    one.generator.inference_engine = dataclasses.replace(one.generator.inference_engine, num_engines=16)
    assert one == two


def test_overrides_apply_on_top_of_a_recipe_and_are_checked(in_run_dir):
    _gsm8k_data(in_run_dir)
    cfg = compose_config(["trainer.total_steps=5", "algorithm=ppo"], RECIPES, "gsm8k_qwen0.5b_1node")
    assert cfg.trainer.total_steps == 5 and cfg.trainer.algorithm.advantage_estimator == "gae"
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.total_step'; did you mean"):
        compose_config(["trainer.total_step=5"], RECIPES, "gsm8k_qwen0.5b_1node")
    with pytest.raises(ConfigError, match=r"trainer.train_batch_size=64 is not divisible by .*=5"):
        compose_config(["trainer.policy_mini_batch_size=5"], RECIPES, "gsm8k_qwen0.5b_1node")


def test_a_misspelled_recipe_names_the_recipes():
    with pytest.raises(ConfigError, match=r"'gsm8k_1node' is not a recipe in .*recipes: \['cpu_default'"):
        compose_config([], RECIPES, "gsm8k_1node")


def test_cli_composes_a_recipe_like_compose_config(in_run_dir):
    _gsm8k_data(in_run_dir)
    args = ["--config-dir", str(RECIPES), "--config-name", "gsm8k_qwen0.5b_2nodes", "trainer.seed=7"]
    result = subprocess.run(
        [sys.executable, "-m", "skyrl.train", *args, "--cfg", "job"],
        capture_output=True,
        text=True,
        check=True,
    )
    printed = yaml.safe_load(result.stdout)
    expected = dataclasses.asdict(compose_config(["trainer.seed=7"], RECIPES, "gsm8k_qwen0.5b_2nodes"))
    assert printed == expected


def test_cli_names_the_recipes_for_a_misspelled_one(in_run_dir):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "skyrl.train",
            "--config-dir",
            str(RECIPES),
            "--config-name",
            "gsm8k_qwen0.5b",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("config error: --config-name 'gsm8k_qwen0.5b' is not a recipe")
    assert "did you mean gsm8k_qwen0.5b_1node?" in result.stderr
    assert list(in_run_dir.iterdir()) == []
