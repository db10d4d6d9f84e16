"""Multi-turn tool use: the model calls a calculator, reads the result, and answers.

Two protocols. Text (the default): the model writes `<tool>EXPRESSION</tool>` to call the calculator
(the env replies `<result>VALUE</result>`). Function calling (`function_calling: true` in the env's
config): the env declares a `calculator` tool (OpenAI function definition, `{"expression": str}`), the
model calls it in its chat template's format (parsed by `generator.http_endpoint.tool_parser`), and
the env answers each call with a `role: "tool"` message. Either way `<answer>VALUE</answer>` finishes;
reward 1 when the answer equals `extras['answer']`. Expressions are evaluated by a small arithmetic
parser (numbers, + - * / // % **, parentheses), never `eval`.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any

from skyrl.envs.base import BaseTextEnv, BaseTextEnvStepOutput, Message, ToolCall
from skyrl.envs.math_env import answers_match

TOOL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
SYSTEM_PROMPT = (
    "Compute the expression. Use the calculator tool: <tool>3 * (4 + 5)</tool>, "
    "then give the result as <answer>27</answer>."
)
FUNCTION_CALLING_PROMPT = (
    "Compute the expression. Call the calculator, then give the result as <answer>27</answer>."
)
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "The value of an arithmetic expression (+ - * / // % **, parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 3 * (4 + 5)"}},
            "required": ["expression"],
        },
    },
}
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


def evaluate(expression: str) -> str:
    """The expression's value as the env answers it, or the error."""
    try:
        return format_number(safe_eval(expression))
    except ValueError as e:
        return f"error: {e}"


def format_number(x: int | float) -> str:
    """Integers without a decimal point, other values rounded to 6 significant digits."""
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"


class CalculatorEnv(BaseTextEnv):
    """env_config: `max_turns` (4), `function_calling` (false: the text protocol). extras: `answer`."""

    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None):
        super().__init__(env_config, extras)
        if "answer" not in self.extras:
            raise ValueError("calculator needs the ground truth in the dataset row's 'answer' column")
        self.truth = str(self.extras["answer"])
        self.max_turns = int(self.env_config.get("max_turns", 4))
        self.function_calling = bool(self.env_config.get("function_calling", False))
        self.turns = 0
        self.tool_calls = 0

    def tools(self) -> list[dict[str, Any]] | None:
        return [CALCULATOR_TOOL] if self.function_calling else None

    def step(self, action: str, tool_calls: list[ToolCall] | None = None) -> BaseTextEnvStepOutput:
        self.turns += 1
        answer = ANSWER.search(action)
        if answer:
            correct = answers_match(answer.group(1), self.truth)
            return BaseTextEnvStepOutput(
                [], 1.0 if correct else 0.0, True, {"answer": answer.group(1).strip()}
            )
        done = self.turns >= self.max_turns
        if tool_calls:
            self.tool_calls += len(tool_calls)
            results = [
                {"role": "tool", "tool_call_id": c["id"], "content": self._call(c)} for c in tool_calls
            ]
            return BaseTextEnvStepOutput(results, 0.0, done)
        call = None if self.function_calling else TOOL.search(action)
        if call is None:
            expected = "a calculator call" if self.function_calling else "<tool>...</tool>"
            return BaseTextEnvStepOutput(
                [], 0.0, True, {"error": f"neither {expected} nor <answer>...</answer>"}
            )
        self.tool_calls += 1
        result = evaluate(call.group(1))
        return BaseTextEnvStepOutput([{"role": "user", "content": f"<result>{result}</result>"}], 0.0, done)

    @staticmethod
    def _call(call: ToolCall) -> str:
        function = call["function"]
        if function["name"] != "calculator":
            return f"error: no tool {function['name']!r}; the tool is 'calculator'"
        expression = function["arguments"].get("expression")
        return (
            evaluate(expression) if isinstance(expression, str) else "error: give the expression as a string"
        )

    def get_metrics(self) -> dict[str, float]:
        return {"tool_calls": float(self.tool_calls)}


def make_dataset(
    num_rows: int, seed: int = 0, max_operand: int = 20, function_calling: bool = False
) -> list[dict[str, Any]]:
    """Deterministic rows of 2-3 operation expressions with their `answer`; the system prompt describes the
    text protocol, or the calculator function with `function_calling`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        expression = str(rng.randint(1, max_operand))
        for _ in range(rng.randint(2, 3)):
            expression = f"{expression} {rng.choice('+-*')} {rng.randint(1, max_operand)}"
            if rng.random() < 0.3:
                expression = f"({expression})"
        prompt: list[Message] = [
            {"role": "system", "content": FUNCTION_CALLING_PROMPT if function_calling else SYSTEM_PROMPT},
            {"role": "user", "content": expression},
        ]
        rows.append(
            {"prompt": prompt, "env_class": "calculator", "answer": format_number(safe_eval(expression))}
        )
    return rows
