"""The bring-your-own-agent example: trained by its recipe alone, through the HTTP endpoint."""

from pathlib import Path

from transformers import AutoTokenizer

from skyrl.train.config import compose_config
from skyrl.train.trainer import Trainer, load_datasets

ROOT = Path(__file__).resolve().parents[2]
KV = "generator.inference_engine.kv_cache_memory_bytes=67108864"


def test_the_openai_agent_example_learns_by_its_recipe(ray_cluster, tiny_model_path, tmp_path):
    """The recipe's agent plays the default job's game with the openai client; the margin rule is the
    env-based learning test's (random guessing scores ~0.4, a 10-step mean moves ~0.02 from noise), over
    100 steps: at 70, one of four fresh-clone CI runs stayed flat (0.420 -> 0.422)."""
    overrides = ["trainer.total_steps=100", "trainer.logger=[jsonl]", KV]
    cfg = compose_config(overrides, ROOT / "configs", "openai_agent")
    assert cfg.generator.agent == "examples.openai_agent.agent:play"
    trainer = Trainer(
        cfg,
        tmp_path,
        str(tiny_model_path),
        load_datasets(cfg, AutoTokenizer.from_pretrained(tiny_model_path)),
    )
    try:
        history = trainer.fit()
    finally:
        trainer.shutdown()
    rewards = [round(m["reward/mean"], 3) for m in history]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.06, rewards
    assert all(m["episode/prefix_consistent_fraction"] == 1.0 for m in history)  # continued token for token
    assert all(m["episode/env_failures"] == 0 and m["env/guesses"] >= 1 for m in history)
