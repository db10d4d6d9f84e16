"""The generator interface: what the trainer asks of a rollout system, and the three ways to get one.

- the env-based `RolloutManager` (the default): episodes against `BaseTextEnv`s;
- `generator.agent=package.module:function`: the user's agent, through the HTTP endpoint
  (`skyrl.train.generator.agent`);
- `generator.generator_class=package.module:Class`: a whole rollout system of the user's, built as
  `Class(client, tokenizer, cfg, env)` like the rollout manager: `client` is the
  `InferenceEngineClient` (`await client.generate(prompt_ids, SamplingParams(...), session_id)`
  returns token ids, logprobs and the weight version), `tokenizer` the policy's, `cfg` the
  `generator` section and `env` the `environment` section.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

from skyrl.train.dataset.prompt_dataset import PromptRow
from skyrl.train.generator.agent import AgentGenerator
from skyrl.train.generator.rollout import GeneratorOutput, RolloutManager
from skyrl.train.inference.openai_server import OpenAIServer
from skyrl.train.schema import EnvironmentConfig, GeneratorConfig, SamplingConfig
from skyrl.train.utils.errors import ConfigError
from skyrl.train.utils.imports import load_entry_point


@runtime_checkable
class Generator(Protocol):
    """A rollout system: `agenerate` returns, for every prompt, `n_samples_per_prompt` finished
    `Episode`s, contiguous and in prompt order, whose trajectories carry the prompt's uid (`uids[i]`,
    default `p{i}`) and ids unique in the batch (e.g. `uid/sample`).

    Each `Turn` is one LLM call: the context ids the model saw, the ids it generated with their
    engine logprobs (the `generator.sampling` distribution), the loss mask (1 on tokens to train on),
    the turn's reward and the engine's weight version. `sampling` and `n_samples_per_prompt` default to
    the `generator` section's; eval passes its own. A failed episode is an `Episode` with
    `stop_reason="error"` (loss-masked per `generator.env_failure`), not an exception; raise only
    when the whole batch is lost (e.g. a dead engine). The trainer computes the reward and episode
    metrics from the episodes (an episode's `env_metrics` are logged as `env/<name>` means), so
    `GeneratorOutput.metrics` is for callers of the generator itself.
    """

    async def agenerate(
        self,
        prompts: list[PromptRow],
        uids: list[str] | None = None,
        sampling: SamplingConfig | None = None,
        n_samples_per_prompt: int | None = None,
    ) -> GeneratorOutput: ...


def load_generator_class(spec: str) -> type:
    """The class `generator.generator_class` names; `ConfigError` unless it has an async `agenerate`."""
    cls = load_entry_point(spec, "generator.generator_class")
    if not (inspect.isclass(cls) and inspect.iscoroutinefunction(getattr(cls, "agenerate", None))):
        raise ConfigError(
            f"generator.generator_class={spec!r} is {cls!r}, not a class with `async def agenerate(prompts, "
            "uids, sampling, n_samples_per_prompt)` (skyrl.train.generator.base.Generator)"
        )
    return cls


def build_generator(
    client: Any, tokenizer: Any, cfg: GeneratorConfig, env: EnvironmentConfig, server: OpenAIServer | None
) -> Generator:
    """The run's generator: the user's agent (served through `server`), the user's class, or the
    env-based rollout manager."""
    if cfg.agent is not None:
        assert server is not None, "an agent needs the HTTP endpoint"
        return AgentGenerator(server, tokenizer, cfg, env)
    if cfg.generator_class is not None:
        return load_generator_class(cfg.generator_class)(client, tokenizer, cfg, env)
    return RolloutManager(client, tokenizer, cfg, env)


async def generate_checked(
    generator: Generator,
    prompts: list[PromptRow],
    uids: list[str],
    n_samples_per_prompt: int,
    sampling: SamplingConfig | None = None,
) -> GeneratorOutput:
    """`generator.agenerate(...)`, each episode given its prompt row; `RuntimeError` naming the generator
    unless its episodes are `n_samples_per_prompt` per prompt, contiguous in prompt order under the
    prompt's uid."""
    out = await generator.agenerate(prompts, uids, sampling, n_samples_per_prompt)
    got = [e.trajectory.uid for e in out.episodes]
    expected = [uid for uid in uids for _ in range(n_samples_per_prompt)]
    if got != expected:
        raise RuntimeError(
            f"{type(generator).__name__}.agenerate returned episodes of uids {got[:8]}... for prompts "
            f"{uids[:4]}... x {n_samples_per_prompt} samples; a generator returns n_samples_per_prompt "
            "episodes per prompt, contiguous and in prompt order, each trajectory under its prompt's uid"
        )
    for i, episode in enumerate(out.episodes):
        episode.row = prompts[i // n_samples_per_prompt]
    return out
