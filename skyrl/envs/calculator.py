"""Multi-turn tool use: the model calls a calculator, reads the result, and answers.

The model writes `<tool>EXPRESSION</tool>` to call the calculator (the env replies
`<result>VALUE</result>`) and `<answer>VALUE</answer>` to finish; reward 1 when
the answer equals `extras['answer']`. Expressions are evaluated by a small
arithmetic parser (numbers, + - * / // % **, parentheses), never `eval`.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any

from skyrl.envs.base import BaseTextEnv, BaseTextEnvStepOutput, Message
from skyrl.envs.math_env import answers_match

TOOL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
SYSTEM_PROMPT = (
    "Compute the expression. Use the calculator tool: <tool>3 * (4 + 5)</tool>, "
    "then give the result as <answer>27</answer>."
)
BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30


def safe_eval(expression: str) -> int | float:
    """Value of an arithmetic expression; `ValueError` for anything else or out-of-range results."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
            try:
                result = BINARY[type(node.op)](left, right)
            except ZeroDivisionError as e:
                raise ValueError("division by zero") from e
            if isinstance(result, complex) or abs(result) > MAX_MAGNITUDE:
                raise ValueError("result out of range")
            return result
        raise ValueError(f"unsupported element {type(node).__name__} in {expression!r}")

    return value(tree.body)


def format_number(x: int | float) -> str:
    """Integers without a decimal point, other values rounded to 6 significant digits."""
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"


class CalculatorEnv(BaseTextEnv):
    """env_config: `max_turns` (4). extras: `answer`."""

    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None):
        super().__init__(env_config, extras)
        if "answer" not in self.extras:
            raise ValueError("calculator needs the ground truth in the dataset row's 'answer' column")
        self.truth = str(self.extras["answer"])
        self.max_turns = int(self.env_config.get("max_turns", 4))
        self.turns = 0
        self.tool_calls = 0

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        answer = ANSWER.search(action)
        if answer:
            correct = answers_match(answer.group(1), self.truth)
            return BaseTextEnvStepOutput(
                [], 1.0 if correct else 0.0, True, {"answer": answer.group(1).strip()}
            )
        call = TOOL.search(action)
        if call is None:
            return BaseTextEnvStepOutput(
                [], 0.0, True, {"error": "neither <tool>...</tool> nor <answer>...</answer>"}
            )
        self.tool_calls += 1
        try:
            result = format_number(safe_eval(call.group(1)))
        except ValueError as e:
            result = f"error: {e}"
        done = self.turns >= self.max_turns
        return BaseTextEnvStepOutput([{"role": "user", "content": f"<result>{result}</result>"}], 0.0, done)

    def get_metrics(self) -> dict[str, float]:
        return {"tool_calls": float(self.tool_calls)}


def make_dataset(num_rows: int, seed: int = 0, max_operand: int = 20) -> list[dict[str, Any]]:
    """Deterministic rows of 2-3 operation expressions with their `answer`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        expression = str(rng.randint(1, max_operand))
        for _ in range(rng.randint(2, 3)):
            expression = f"{expression} {rng.choice('+-*')} {rng.randint(1, max_operand)}"
            if rng.random() < 0.3:
                expression = f"({expression})"
        prompt: list[Message] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": expression},
        ]
        rows.append(
            {"prompt": prompt, "env_class": "calculator", "answer": format_number(safe_eval(expression))}
        )
    return rows
