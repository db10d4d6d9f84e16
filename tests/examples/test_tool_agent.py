"""The OpenAI Agents SDK example: an unchanged SDK agent with a function tool, trained by its recipe."""

from pathlib import Path

from transformers import AutoTokenizer

from skyrl.train.config import compose_config
from skyrl.train.sampler import load_datasets
from skyrl.train.trainer import Trainer
from skyrl.train.utils.tiny_tools_model import create_tiny_tools_model

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "trainer.total_steps=3",
    "trainer.train_batch_size=4",
    "trainer.policy_mini_batch_size=4",
    "generator.n_samples_per_prompt=4",
    "trainer.logger=[jsonl]",
    "generator.inference_engine.backend=hf",  # the subject is the SDK and the endpoint, not vLLM
]


def test_the_agents_sdk_example_calls_its_tool_and_trains_by_its_recipe(ray_cluster, tmp_path):
    """The SDK sends OpenAI function-calling requests (tools, assistant tool_calls, tool results); the
    endpoint parses the tiny-tools model's calls for it, the SDK runs the calculator, and every step
    trains on the recorded requests, continued token for token across the tool turns where the chat
    template renders the history as generated."""
    cfg = compose_config(SMALL, ROOT / "configs", "tool_agent")
    assert cfg.generator.agent == "examples.tool_agent.agent:solve"
    assert cfg.trainer.policy.model.path == "tiny-tools"
    model = create_tiny_tools_model(tmp_path / "tiny-tools")
    trainer = Trainer(
        cfg, tmp_path / "run", str(model), load_datasets(cfg, AutoTokenizer.from_pretrained(model))
    )
    try:
        history = trainer.fit()
    finally:
        trainer.shutdown()
    assert len(history) == 3
    assert all(m["env/tool_calls"] > 0 and m["episode/turns"] > 1 for m in history)  # the SDK ran the tool
    # Continued token for token where the template allows: a sampled call followed by stray text (the
    # parser answers the call, the template renders it without the text) is rendered afresh, as it must
    # be (3 of 768 episodes of the untrained model); without continuation the fraction would be ~0.2.
    assert min(m["episode/prefix_consistent_fraction"] for m in history) >= 0.75
    assert all(m["episode/env_failures"] == 0 and m["policy/loss_tokens"] > 0 for m in history)
    assert any(m["policy/grad_norm"] > 0 for m in history)
