"""Single-turn chat without a reward of its own: the run's reward sources (`reward.sources`, e.g. a reward
model or an LLM judge) score the answer, as in RLHF."""

from __future__ import annotations

from skyrl.envs.base import BaseTextEnv, BaseTextEnvStepOutput


class ChatEnv(BaseTextEnv):
    """One turn, reward 0: the episode is the prompt and the model's answer."""

    def step(self, action: str) -> BaseTextEnvStepOutput:
        return BaseTextEnvStepOutput([], 0.0, True)
