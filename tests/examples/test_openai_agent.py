"""The bring-your-own-agent example: trained by its recipe alone, through the HTTP endpoint."""

from pathlib import Path

from transformers import AutoTokenizer

from skyrl.train.config import compose_config
from skyrl.train.sampler import load_datasets
from skyrl.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
HF = "generator.inference_engine.backend=hf"  # the subject is the agent path; vLLM is the engine tests'


def test_the_openai_agent_example_trains_by_its_recipe(ray_cluster, tiny_model_path, tmp_path):
    """The recipe's agent plays the default job's game with the openai client, and every step trains on
    its recorded requests, continued token for token, without a failed episode. That it learns follows
    from its trajectories equalling the env path's (tests/train/generator/test_agent.py) and the env
    path's learning test; a learning run of its own cost 270-460 s of the suite."""
    overrides = [
        "trainer.total_steps=3",
        "trainer.train_batch_size=4",  # 16 episodes a step, not the default 128: the path, not the scale
        "trainer.policy_mini_batch_size=4",
        "generator.n_samples_per_prompt=4",
        "trainer.logger=[jsonl]",
        HF,
    ]
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
    assert len(history) == 3
    assert all(m["episode/prefix_consistent_fraction"] == 1.0 for m in history)  # continued token for token
    assert all(m["episode/env_failures"] == 0 and m["env/guesses"] >= 1 for m in history)
    assert all(m["policy/loss_tokens"] > 0 for m in history)
    assert any(m["policy/grad_norm"] > 0 for m in history)
