"""Guess the number, played by an agent that knows only the OpenAI API.

The run calls `play(row, client_info)` once per prompt x sample. The agent keeps its own chat
history, asks the model for a guess with the official `openai` client, answers "Higher." or
"Lower." itself and returns the reward: 1 when a guess hits the hidden number within
`MAX_TURNS`, else 0. Nothing here is skyrl-specific except the session header and the result type.
"""

from __future__ import annotations

import re

from skyrl.train.generator.agent import AgentResult, ClientInfo

MAX_TURNS = 4
NUMBER = re.compile(r"-?\d+")


async def play(row, client_info: ClientInfo) -> AgentResult:
    """`row.prompt` is the chat prompt ("Guess the hidden number between 1 and 8..."), `row.extras`
    the dataset row's other columns (here the hidden `target`)."""
    client = client_info.openai_client()  # one per event loop, shared by the episodes
    messages = list(row.prompt)
    target = int(row.extras["target"])
    for turn in range(1, MAX_TURNS + 1):
        reply = await client.chat.completions.create(
            model=client_info.model,
            messages=messages,
            max_tokens=1,
            extra_headers=client_info.headers,  # X-Session-Id: the run records this episode's requests
        )
        text = reply.choices[0].message.content or ""
        match = NUMBER.search(text)
        if match is None:
            return AgentResult(reward=0.0, metrics={"guesses": turn})
        if int(match.group()) == target:
            return AgentResult(reward=1.0, metrics={"guesses": turn})
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Higher." if int(match.group()) < target else "Lower."},
        ]
    return AgentResult(reward=0.0, metrics={"guesses": MAX_TURNS})
