"""The environment API users write against: `BaseTextEnv` with `init` and `step`."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, str]


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

    def close(self) -> None:  # noqa: B027 (optional hook, not abstract)
        """Release resources; called once per episode, also after a failure."""

    def get_metrics(self) -> dict[str, float]:
        """Episode-level metrics to aggregate (optional)."""
        return {}
