"""Single-turn math with a checkable final answer (GSM8K style: `#### 42` or `\\boxed{42}`)."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from skyrl.envs.base import BaseTextEnv, BaseTextEnvStepOutput

HASHES = re.compile(r"####\s*([^\n]+)")
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def extract_answer(text: str) -> str | None:
    """The last `#### x` or `\\boxed{x}` answer in `text`, or None."""
    candidates = [(m.start(), m.group(1)) for pattern in (HASHES, BOXED) for m in pattern.finditer(text)]
    return max(candidates)[1].strip() if candidates else None


def normalize_number(text: str) -> Fraction | None:
    """Numbers such as `'1,234.50'`, `'$12'` or `'3/4'` as exact fractions; None for anything else."""
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str, truth: str) -> bool:
    """Numerically equal when both are numbers, else equal as trimmed strings."""
    a, b = normalize_number(predicted), normalize_number(truth)
    if a is not None and b is not None:
        return a == b
    return predicted.strip() == truth.strip()


class MathEnv(BaseTextEnv):
    """One turn; reward 1 if the final answer matches `extras['answer']`, else 0."""

    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None):
        super().__init__(env_config, extras)
        if "answer" not in self.extras:
            raise ValueError("math needs the ground truth in the dataset row's 'answer' column")
        self.truth = str(self.extras["answer"])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        predicted = extract_answer(action)
        if predicted is None:
            return BaseTextEnvStepOutput([], 0.0, True, {"error": "no final answer (#### x or \\boxed{x})"})
        correct = answers_match(predicted, self.truth)
        return BaseTextEnvStepOutput([], 1.0 if correct else 0.0, True, {"predicted": predicted})
