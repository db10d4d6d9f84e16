"""OpenAI function calling on the endpoint: `tools` and `tool_choice` in, `tool_calls` out.

A request's messages reach the chat template as it expects them (`template_messages`): text content
parts joined, an assistant message's `reasoning` as `reasoning_content` (`inference.reasoning`) and its
`tool_calls[].function.arguments` (a JSON string in OpenAI's format) as an object, and each tool
message answering a call made earlier in the conversation. The tools reach it as
`apply_chat_template(messages, tools=...)`.

What the model generated is parsed with vLLM's tool parsers (`ToolCalls`), chosen by
`generator.http_endpoint.tool_parser`: a parser's name (`hermes` for Qwen2.5), `auto` (`hermes` when
the chat template writes `<tool_call>` tags and vLLM is installed, else none) or `none` (requests
with tools get a 400).
The parser reads the text decoded with special tokens kept; output that does not parse as a call is
answered as plain content and counted (`ToolCalls.parse_failures`).

`tool_choice="required"` or a named function is served by writing the opening of a call in the parser's
format after the prompt (`CALL_OPENINGS`): the model writes the rest. The opening is part of the prompt
(context in a training session, never trained on), so nothing is masked and the recorded logprobs are
those of the distribution sampled from. Openings end where byte-level BPE starts a new pre-token, so
opening + generated tokens are the template's tokens of the whole call. Parsers without a known opening
answer such a request with a 400.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from skyrl.train.utils.errors import ConfigError

logger = logging.getLogger(__name__)

PARSER_KEY = "generator.http_endpoint.tool_parser"

# The opening of a call in a parser's format, for tool_choice "required" ({name} None) and for a named
# function; each ends at a pre-token boundary (a newline, or a space before JSON punctuation).
CALL_OPENINGS: dict[str, tuple[str, str]] = {
    "hermes": ("<tool_call>\n", '<tool_call>\n{{"name": {name}, "arguments":'),
}


class ToolRequestError(ValueError):
    """A request whose tools, tool choice or tool messages are inconsistent (the endpoint answers 400)."""


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` (OpenAI's chat format, None fields left out) as chat templates take them;
    `ToolRequestError` naming the message for arguments that are not JSON, non-text content parts, or a
    tool message whose `tool_call_id` answers no earlier call."""
    called: set[str] = set()
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        reasoning = message.pop("reasoning", None)  # as answered; templates read `reasoning_content`
        if reasoning is not None:
            message.setdefault("reasoning_content", reasoning)
        content = message.get("content")
        if isinstance(content, list):
            kinds = {part.get("type") for part in content}
            if kinds - {"text"}:
                raise ToolRequestError(
                    f"messages[{i}].content: only text parts are served, not {sorted(kinds)}"
                )
            message["content"] = "".join(part.get("text", "") for part in content)
        if message.get("content") is None and not (
            message["role"] == "assistant" and message.get("tool_calls")
        ):
            raise ToolRequestError(
                f"messages[{i}] ({message['role']}) has no content; only an assistant message "
                "with tool_calls may leave it out"
            )
        calls = []
        for j, call in enumerate(message.get("tool_calls") or ()):
            function = dict(call["function"])
            try:
                function["arguments"] = json.loads(function.get("arguments") or "{}")
            except json.JSONDecodeError as exc:
                raise ToolRequestError(
                    f"messages[{i}].tool_calls[{j}].function.arguments is not JSON ({exc}): "
                    f"{function.get('arguments')!r}"
                ) from exc
            calls.append({**call, "function": function})
            called.add(call["id"])
        if calls:
            message["tool_calls"] = calls
        if message["role"] == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in called:
                raise ToolRequestError(
                    f"messages[{i}] is a tool message with tool_call_id={call_id!r}, which answers no tool call "
                    f"of an earlier assistant message (ids: {sorted(called)})"
                )
        out.append(message)
    return out


def check_tool_choice(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> None:
    """`ToolRequestError` for a `tool_choice` the request's `tools` do not allow."""
    if tool_choice is None:
        return
    if not tools:
        raise ToolRequestError(
            f"tool_choice={tool_choice!r} is only allowed with tools; send tools or leave it out"
        )
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        names = [tool["function"]["name"] for tool in tools]
        if name not in names:
            raise ToolRequestError(
                f"tool_choice names function {name!r}, which is not among the tools {names}"
            )


@dataclass(frozen=True)
class ToolUse:
    """How a chat request uses tools: the `tools` offered to the model, whether `parallel` calls are
    answered, and the `opening` of a call written after the prompt (`ToolCalls.opening`)."""

    tools: list[dict[str, Any]]
    parallel: bool = True
    opening: str = ""


@dataclass
class Parsed:
    """What one answer says: its text `content` (None when it is only calls) and its `tool_calls` as chat
    templates and envs take them (`id`, `type`, `function.name`, `function.arguments` as an object; the
    endpoint sends the arguments as a JSON string)."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def resolve_tool_parser(name: str, chat_template: str | None) -> str | None:
    """The parser `tool_parser=name` means: None for `none`, or for `auto` when the chat template writes
    no `<tool_call>` tags."""
    if name == "none":
        return None
    if name == "auto":
        return "hermes" if "<tool_call>" in (chat_template or "") else None
    return name


class ToolCalls:
    """Tool-call parsing for one tokenizer with vLLM's parser `name` (see `resolve_tool_parser`);
    `ConfigError` naming the key and the installed parsers when vLLM lacks it. With `auto` vLLM's parsers
    are imported at the first parse (seconds a run that never sends tools does not pay)."""

    def __init__(self, tokenizer: Any, name: str):
        self.tokenizer, self.requested = tokenizer, name
        self.name = resolve_tool_parser(name, getattr(tokenizer, "chat_template", None))
        self.parse_failures = 0
        if self.name is None:
            return
        if importlib.util.find_spec("vllm") is None:
            if name == "auto":  # a run that never sends tools must not need vLLM
                logger.warning(
                    "vLLM is not installed: the endpoint parses no tool calls (%s=auto)", PARSER_KEY
                )
                self.name = None
                return
            raise ConfigError(
                f"{PARSER_KEY}={name!r} uses vLLM's tool parsers, and vLLM is not installed; install the `cpu` "
                f"or `vllm` extra, or set {PARSER_KEY}=none"
            )
        if name != "auto":
            self._parser_cls  # noqa: B018  (a misspelt parser is a config error at start-up, not at a request)

    @functools.cached_property
    def _parser_cls(self) -> Any:
        from vllm.tool_parsers import ToolParserManager

        installed = sorted(ToolParserManager.list_registered())
        if self.name not in installed:
            raise ConfigError(
                f"{PARSER_KEY}={self.requested!r} is not an installed tool parser; one of {installed}"
            )
        parser_cls = ToolParserManager.get_tool_parser(self.name)
        # a parse failure is counted and answered as content: the parser's own traceback is noise
        logging.getLogger(parser_cls.__module__).setLevel(logging.CRITICAL)
        return parser_cls

    def check(self, tools: list[dict[str, Any]] | None) -> None:
        if tools and self.name is None:
            raise ToolRequestError(
                f"this endpoint parses no tool calls ({PARSER_KEY} is none, or auto found no tool-call tags "
                f"in the chat template); set {PARSER_KEY}, e.g. hermes for Qwen2.5"
            )

    def opening(self, tool_choice: str | dict[str, Any] | None) -> str:
        """The text written after the prompt so the answer is a call: "" for `auto`/`none`, the opening of
        any call for `required`, of a call to the named function for `{"type": "function", ...}`;
        `ToolRequestError` for a parser whose call format has no known opening."""
        if tool_choice in (None, "auto", "none"):
            return ""
        if self.name not in CALL_OPENINGS:
            raise ToolRequestError(
                f"tool_choice={tool_choice!r} is served by writing the opening of a call in the tool parser's "
                f"format, and {PARSER_KEY}={self.name!r} has none (known: {sorted(CALL_OPENINGS)}); "
                "send tool_choice='auto'"
            )
        required, named = CALL_OPENINGS[self.name]
        if tool_choice == "required":
            return required
        assert isinstance(tool_choice, dict)
        return named.format(name=json.dumps(tool_choice["function"]["name"], ensure_ascii=False))

    def parse(self, text: str, content: str, tools: list[dict[str, Any]], parallel: bool) -> Parsed:
        """The calls in `text` (the answer decoded with special tokens kept); `content` (decoded without
        them) when it holds none (also when a call's arguments are not a JSON object: a parse failure).
        With `parallel` False only the first call is answered."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(
            model="skyrl", messages=[{"role": "user", "content": ""}], tools=tools, tool_choice="auto"
        )
        parser = self._parser_cls(self.tokenizer, request.tools)
        info = parser.extract_tool_calls(text, request)
        if not info.tools_called:
            start = getattr(parser, "tool_call_start_token", None)
            if start and start in text:
                self.parse_failures += 1
            return Parsed(content)
        try:
            arguments = [json.loads(call.function.arguments or "{}") for call in info.tool_calls]
        except json.JSONDecodeError:
            arguments = [None]
        if not all(isinstance(a, dict) for a in arguments):  # arguments must be a JSON object
            self.parse_failures += 1
            return Parsed(content)
        calls = [
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": a}}
            for call, a in zip(info.tool_calls, arguments, strict=True)
        ]
        return Parsed(info.content or None, calls if parallel else calls[:1])
