"""A reasoning model's thinking answered apart from its content, as vLLM's `--reasoning-parser` does.

`generator.http_endpoint.reasoning_parser` names one of vLLM's reasoning parsers (`qwen3`,
`deepseek_r1`, ...); `none` (the default) answers the text as the model wrote it. With a parser, a chat
answer's `message.reasoning` holds the thinking (vLLM's field; clients such as the OpenAI Agents SDK
read it) and `content` the rest; tool calls are parsed from the content the parser leaves (parsers
differ: `qwen3` ends the thinking at a `<tool_call>` tag, `deepseek_r1` keeps a call inside `<think>` as
thinking). What a session records is the generated tokens either way. An assistant
message sent back with `reasoning` (or `reasoning_content`) reaches the chat template as
`reasoning_content`, the name reasoning templates (Qwen3's) read; whether the template renders earlier
turns' thinking as generated decides whether a session continues token for token (Qwen3's renders it
only for the turns after the last user message).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from skyrl.train.utils.errors import ConfigError

REASONING_KEY = "generator.http_endpoint.reasoning_parser"


class Reasoning:
    """Splits answers with vLLM's reasoning parser `name` (`none`: no split); `ConfigError` naming the
    key and the installed parsers for a name vLLM lacks, or for a tokenizer the parser cannot read."""

    def __init__(self, tokenizer: Any, name: str):
        self.name = None if name == "none" else name
        self._parser: Any = None
        if self.name is None:
            return
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                f"{REASONING_KEY}={name!r} uses vLLM's reasoning parsers, and vLLM is not installed; install "
                f"the `cpu` or `vllm` extra, or set {REASONING_KEY}=none"
            )
        from vllm.reasoning import ReasoningParserManager

        installed = sorted(ReasoningParserManager.list_registered())
        if name not in installed:
            raise ConfigError(
                f"{REASONING_KEY}={name!r} is not an installed reasoning parser; one of {installed}"
            )
        try:
            self._parser = ReasoningParserManager.get_reasoning_parser(name)(tokenizer)
        except Exception as exc:  # e.g. a tokenizer without the parser's think tokens
            raise ConfigError(f"{REASONING_KEY}={name!r} cannot parse this model's output: {exc}") from exc
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        # the parsers take the request for its settings; none of ours varies by request
        self._request = ChatCompletionRequest(model="skyrl", messages=[{"role": "user", "content": ""}])

    def split(self, text: str) -> tuple[str | None, str]:
        """`text`'s reasoning (None without a parser, or when it has none) and its content."""
        if self._parser is None:
            return None, text
        reasoning, content = self._parser.extract_reasoning(text, self._request)
        return reasoning or None, content or ""
