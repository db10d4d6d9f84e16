"""The environment API users write against: `BaseTextEnv` with `init` and `step`."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]
# A parsed tool call: {"id": str, "type": "function", "function": {"name": str, "arguments": dict}}
ToolCall = dict[str, Any]


@dataclass
class BaseTextEnvStepOutput:
    """What one `step` returns: chat messages to append (may be empty), a reward, done, metadata."""

    observations: list[Message]
    reward: float
    done: bool
    metadata: dict[str, Any] = field(default_factory=dict)


class BaseTextEnv(abc.ABC):
    """A text environment for one episode.

    Built as `Env(env_config, extras)`: `env_config` is this env's section of the
    config tree, `extras` the dataset row's extra fields (e.g. the ground truth).
    The rollout manager calls `init(prompt)` once, then `step(action)` with each
    model response until `done` (or the turn / length limits), then `close()`.

    An env that declares `tools` (OpenAI function definitions) gets them in the prompt (the chat
    template's tools section) and each response's calls parsed, as the HTTP endpoint parses them
    (`generator.http_endpoint.tool_parser`): `step(action, tool_calls)`, where `action` is still the
    response's text and `tool_calls` a list of `ToolCall`s (arguments as objects; empty when the
    response calls nothing). It answers a call with a message `{"role": "tool", "tool_call_id": id,
    "content": result}`, which the template renders as a tool result.
    """

    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None):
        self.env_config = dict(env_config or {})
        self.extras = dict(extras or {})

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        """The (possibly modified) chat messages the episode starts from, and metadata."""
        return prompt, {}

    @abc.abstractmethod
    def step(self, action: str) -> BaseTextEnvStepOutput:
        """React to the model's response `action`."""

    def tools(self) -> list[dict[str, Any]] | None:
        """The tools the model may call, as OpenAI function definitions (`{"type": "function", "function":
        {"name", "description", "parameters"}}`); None (the default): the env reads text only."""
        return None

    def close(self) -> None:  # noqa: B027 (optional hook, not abstract)
        """Release resources; called once per episode, also after a failure."""

    def get_metrics(self) -> dict[str, float]:
        """Episode-level metrics to aggregate (optional)."""
        return {}
