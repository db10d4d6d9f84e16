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
format after the prompt (`CALL_FORMATS`): the model writes the rest under a grammar (`SamplingParams.
grammar`, xgrammar in both engines) that admits only calls to the offered functions with arguments
matching their JSON schemas, written as the chat template writes them (`", "` and `": "` separators),
so the answer parses as calls unless `max_tokens` cuts it. The opening is part of the prompt (context
in a training session, never trained on); the rest is sampled from the model's distribution masked to
what the grammar allows, and the recorded logprobs are those of that masked distribution (the trainer's
are unmasked: the difference is an off-policy gap like any other sampler's). Openings end where
byte-level BPE starts a new pre-token, so opening + generated tokens are the template's tokens of the
whole call. Parsers without a known call format answer such a request with a 400.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from skyrl.train.utils.errors import ConfigError

logger = logging.getLogger(__name__)

PARSER_KEY = "generator.http_endpoint.tool_parser"


@dataclass(frozen=True)
class CallFormat:
    """How a parser's format writes calls: `start`, `{"name": ..., "arguments": {...}}`, `end`, with
    `between` before each call after the first (as the chat template renders an assistant's calls)."""

    start: str
    end: str
    between: str

    def calls(self, text: str) -> tuple[list[Any], str] | None:
        """The calls that `text` opens with, each JSON-decoded (so an argument holding `end` stays whole,
        where a parser that cuts at the first `end` would split it), and what follows them; None when
        `text` does not open with a whole call."""
        decoder, calls, at = json.JSONDecoder(), [], 0
        while text.startswith(opening := self.between + self.start if calls else self.start, at):
            at += len(opening)
            try:
                call, at = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                return None
            if not text.startswith(self.end, at):
                return None
            calls.append(call)
            at += len(self.end)
        return (calls, text[at:]) if calls else None


CALL_FORMATS: dict[str, CallFormat] = {"hermes": CallFormat("<tool_call>\n", "\n</tool_call>", "\n")}


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
    answered, and for a constrained `tool_choice` the `opening` of a call written after the prompt and
    the `grammar` of the rest (`ToolCalls.use`)."""

    tools: list[dict[str, Any]]
    parallel: bool = True
    opening: str = ""
    grammar: str | None = None


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

    def use(
        self, tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None, parallel: bool
    ) -> ToolUse:
        """How a request offering `tools` uses them: for `required` a call's opening and the grammar of
        calls to any of them (more calls after it when `parallel`), for a named function the opening up
        to its arguments and their grammar; `ToolRequestError` for a parser without a known call format
        or a parameters schema the grammar cannot take."""
        if tool_choice in (None, "auto", "none"):
            return ToolUse(tools, parallel)
        fmt = CALL_FORMATS.get(self.name or "")
        if fmt is None:
            raise ToolRequestError(
                f"tool_choice={tool_choice!r} is served by constraining the answer to a call in the tool "
                f"parser's format, and {PARSER_KEY}={self.name!r} has none (known: {sorted(CALL_FORMATS)}); "
                "send tool_choice='auto'"
            )
        end = json.dumps(fmt.end)
        if isinstance(tool_choice, dict):
            name = tool_choice["function"]["name"]
            tool = next(t for t in tools if t["function"]["name"] == name)  # check_tool_choice: it is there
            opening = f'{fmt.start}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments":'
            rules = _schema_rules(_parameters(tool), "arguments", name)
            return ToolUse(tools, False, opening, f'root ::= " " arguments "}}" {end}\n{rules}')
        calls = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)},
                    "required": ["name", "arguments"],
                }
                for t in tools
            ]
        }
        rules = _schema_rules(calls, "call", "the tools")
        more = f" ({json.dumps(fmt.between + fmt.start)} call {end})*" if parallel else ""
        return ToolUse(tools, parallel, fmt.start, f"root ::= call {end}{more}\n{rules}")

    def parse(
        self, text: str, content: str, tools: list[dict[str, Any]], parallel: bool, constrained: bool = False
    ) -> Parsed:
        """The calls in `text` (the answer decoded with special tokens kept); `content` (decoded without
        them) when it holds none (also when a call's arguments are not a JSON object: a parse failure).
        With `parallel` False only the first call is answered. A `constrained` answer (`ToolUse.grammar`)
        is calls in the parser's `CALL_FORMATS` and is read as such; unless `max_tokens` cut it."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.renderers.chat_utils import make_tool_call_id

        whole = CALL_FORMATS[self.name or ""].calls(text) if constrained else None
        if whole is not None and whole[1].strip() in ("", *self.tokenizer.all_special_tokens):
            calls = [
                {"id": make_tool_call_id(), "type": "function", "function": call}
                for call in whole[0][: None if parallel else 1]
            ]
            return Parsed(None, calls)

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


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def _schema_rules(schema: dict[str, Any], rule: str, what: str) -> str:
    """EBNF rules where `rule` is a JSON value matching `schema`, written as chat templates' `tojson`
    writes it; `ToolRequestError` naming `what` when xgrammar cannot take the schema."""
    import xgrammar as xgr

    try:
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )
    except (RuntimeError, ValueError) as exc:
        reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc)).strip()  # xgrammar's C++ source prefix
        raise ToolRequestError(f"the parameters schema of {what} cannot constrain a call: {reason}") from exc
    return re.sub(r"^root ::=", f"{rule} ::=", str(grammar), flags=re.M)
