"""The calculator task, played by an agent built with the OpenAI Agents SDK, unchanged.

The run calls `solve(row, client_info)` once per prompt x sample. The agent is an ordinary Agents SDK
`Agent` with one function tool, the calculator (the same JSON schema as `skyrl.envs.calculator`'s
tool), on an `OpenAIChatCompletionsModel` pointed at the run's endpoint: the SDK sends OpenAI function
calling requests (`tools`, assistant `tool_calls`, `role: "tool"` results) and runs the tool itself.
Nothing here is skyrl-specific except the session header and the result type.

Reward: 1 for `<answer>VALUE</answer>` with the right value; `CALL_BONUS` for an episode that called
the calculator but did not answer right (a small model learns to call before it learns to copy); else 0.
"""

from __future__ import annotations

import json
import re

from agents import (
    Agent,
    FunctionTool,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    set_tracing_disabled,
)
from agents.tool_context import ToolContext

from skyrl.envs.calculator import CALCULATOR_TOOL, evaluate
from skyrl.envs.math_env import answers_match
from skyrl.train.generator.agent import AgentResult, ClientInfo

MAX_TURNS = 3
CALL_BONUS = 0.1
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI


def calculator_tool(calls: list[str]) -> FunctionTool:
    """The calculator as an Agents SDK function tool; each expression it is called with goes to `calls`."""

    async def run(ctx: ToolContext, arguments: str) -> str:
        expression = json.loads(arguments).get("expression")
        calls.append(str(expression))
        return (
            evaluate(expression) if isinstance(expression, str) else "error: give the expression as a string"
        )

    function = CALCULATOR_TOOL["function"]
    return FunctionTool(
        name=function["name"],
        description=function["description"],
        params_json_schema=function["parameters"],
        on_invoke_tool=run,
        strict_json_schema=False,
    )


async def solve(row, client_info: ClientInfo) -> AgentResult:
    """`row.prompt` is the calculator prompt (system instructions, the expression as the user's
    message), `row.extras["answer"]` its value."""
    system, user = row.prompt
    calls: list[str] = []
    agent = Agent(
        name="calculator",
        instructions=system["content"],
        tools=[calculator_tool(calls)],
        model=OpenAIChatCompletionsModel(client_info.model, client_info.openai_client()),
        # X-Session-Id: the run records this episode's requests
        model_settings=ModelSettings(extra_headers=client_info.headers),
    )
    try:
        result = await Runner.run(agent, user["content"], max_turns=MAX_TURNS)
        answer = ANSWER.search(str(result.final_output))
    except (
        MaxTurnsExceeded,
        ModelBehaviorError,
    ):  # e.g. a call to a tool it was not given: scored, not failed
        answer = None
    correct = answer is not None and answers_match(answer.group(1), str(row.extras["answer"]))
    reward = 1.0 if correct else CALL_BONUS if calls else 0.0
    return AgentResult(reward=reward, metrics={"tool_calls": float(len(calls)), "correct": float(correct)})
