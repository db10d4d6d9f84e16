"""Guess the number: a multi-turn game small enough for a tiny model to learn from scratch on CPU.

Each turn the model guesses; the env answers "Higher." / "Lower." until the guess
is right (reward 1) or `max_turns` guesses are used (reward 0, or with `shaped`
half a point scaled by how close the last guess was).
"""

from __future__ import annotations

import random
import re
from typing import Any

from skyrl.envs.base import BaseTextEnv, BaseTextEnvStepOutput, Message

NUMBER = re.compile(r"-?\d+")


def system_prompt(min_value: int, max_value: int) -> str:
    return f"Guess the hidden number between {min_value} and {max_value}. Answer with a number."


class GuessNumberEnv(BaseTextEnv):
    """env_config: `min_value` (1), `max_value` (8), `max_turns` (4), `shaped` (False). extras: `target`."""

    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None):
        super().__init__(env_config, extras)
        self.min_value = int(self.env_config.get("min_value", 1))
        self.max_value = int(self.env_config.get("max_value", 8))
        self.max_turns = int(self.env_config.get("max_turns", 4))
        self.shaped = bool(self.env_config.get("shaped", False))
        if "target" not in self.extras:
            raise ValueError("guess_number needs the hidden number in the dataset row's 'target' column")
        self.target = int(self.extras["target"])
        self.turns = 0

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        match = NUMBER.search(action)
        if match is None:
            return BaseTextEnvStepOutput([], 0.0, True, {"error": f"no number in the guess {action!r}"})
        guess = int(match.group())
        if guess == self.target:
            return BaseTextEnvStepOutput([], 1.0, True, {"turns": self.turns})
        if self.turns >= self.max_turns:
            return BaseTextEnvStepOutput([], self._consolation(guess), True, {"turns": self.turns})
        hint = "Higher." if guess < self.target else "Lower."
        return BaseTextEnvStepOutput([{"role": "user", "content": hint}], 0.0, False)

    def _consolation(self, guess: int) -> float:
        if not self.shaped:
            return 0.0
        span = max(1, self.max_value - self.min_value)
        return 0.5 * max(0.0, 1 - abs(guess - self.target) / span)

    def get_metrics(self) -> dict[str, float]:
        return {"guesses": float(self.turns)}


def make_dataset(
    num_rows: int, seed: int = 0, min_value: int = 1, max_value: int = 8
) -> list[dict[str, Any]]:
    """Deterministic prompt rows: chat prompt, `env_class`, and the hidden `target`."""
    rng = random.Random(seed)
    prompt: list[Message] = [
        {"role": "system", "content": system_prompt(min_value, max_value)},
        {"role": "user", "content": "Guess."},
    ]
    return [
        {"prompt": prompt, "env_class": "guess_number", "target": rng.randint(min_value, max_value)}
        for _ in range(num_rows)
    ]
