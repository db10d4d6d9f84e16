"""OpenAI's Responses API (`POST /v1/responses`) served on the chat path.

A request's `instructions` and `input` items become chat messages (`chat_request`): the instructions a
system message, a string input a user message, `message` items by role (`developer` as `system`), each run
of assistant output items sent back (`reasoning`, then a `message`, then `function_call`s, as an answer
lists them) one assistant message with `reasoning`, `content` and `tool_calls`, and each
`function_call_output` a tool message answering its `call_id`. So an agent that sends a response's output
back with its tool results continues its session token for token exactly where a chat agent would. The
answer comes back as output items (`output_items`): the thinking (with a reasoning parser) as a `reasoning`
item, the text as a `message`, each call as a `function_call`; with `stream=true` as the Responses API's
named server-sent events, built from the finished answer (`stream_events`).

Stateless: the conversation travels in `input` (`store` is ignored; `previous_response_id` gets a 400),
and one answer per request. Items other than these (images, files, built-in tools) and structured output
(`text.format` other than text) get a 400 naming them.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from skyrl.train.inference.engine import GenerationOutput
from skyrl.train.inference.openai_format import ChatCompletionRequest


class TextPart(BaseModel):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningItem(BaseModel):
    type: Literal["reasoning"]
    summary: list[TextPart] = []
    content: list[TextPart] | None = None


ITEMS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None  # null, as OpenAI's API takes it: the default (true)
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stream: bool = False
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None


def _text(parts: str | list[TextPart]) -> str:
    return parts if isinstance(parts, str) else "".join(part.text for part in parts)


def input_items(body: ResponsesRequest) -> list[BaseModel]:
    """`body.input` as items; `ValueError` naming an item of a type not served or a malformed one."""
    if isinstance(body.input, str):
        return [MessageItem(role="user", content=body.input)]
    items = []
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind not in ITEMS:
            raise ValueError(
                f"input[{i}] has type {kind!r}; this endpoint serves the item types {sorted(ITEMS)}"
            )
        try:
            items.append(ITEMS[kind].model_validate(item))
        except ValidationError as exc:
            raise ValueError(
                "; ".join(f"input[{i}].{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            ) from exc
    return items


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """`body` as the chat request it means; `ValueError` for a `previous_response_id` or input items not
    served (`input_items`)."""
    text_format = (body.text or {}).get("format") or {"type": "text"}
    if text_format.get("type") != "text":
        raise ValueError(
            f"text.format={text_format.get('type')!r}: structured output is not served; ask for JSON in the "
            "instructions and parse the text"
        )
    if body.previous_response_id is not None:
        raise ValueError(
            "previous_response_id: responses are not stored here; send the whole conversation in `input` "
            "(the response's output items, then the function_call_output items)"
        )
    messages: list[dict[str, Any]] = (
        [{"role": "system", "content": body.instructions}] if body.instructions else []
    )
    items = input_items(body)
    open_turn = False  # whether the last message is an assistant turn that later output items extend
    for item in items:
        last = messages[-1] if open_turn else {}
        if isinstance(item, ReasoningItem):
            thought = _text(item.content if item.content is not None else item.summary)
            messages.append({"role": "assistant", "content": None, "reasoning": thought})
        elif isinstance(item, MessageItem) and item.role == "assistant":
            if last and last["content"] is None and "tool_calls" not in last:
                last["content"] = _text(item.content)
            else:
                messages.append({"role": "assistant", "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if last:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content)})
        open_turn = messages[-1]["role"] == "assistant"
    for message in messages:  # an answer that was thinking only has empty text, as the chat path answers
        if message["role"] == "assistant" and message["content"] is None and "tool_calls" not in message:
            message["content"] = ""
    tools = [
        {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
        for tool in body.tools or ()
    ]
    choice = body.tool_choice
    if isinstance(choice, NamedFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        tools=tools or None,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        max_tokens=body.max_output_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k,
        seed=body.seed,
    )


def output_items(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """An answer (an assistant message in the chat template's form) as Responses output items."""
    items: list[dict[str, Any]] = []
    if answer.get("reasoning_content") is not None:
        text = {"type": "reasoning_text", "text": answer["reasoning_content"]}
        items.append(
            {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [text], "status": "completed"}
        )
    if answer.get("content") is not None or not answer.get("tool_calls"):
        text = {"type": "output_text", "text": answer.get("content") or "", "annotations": [], "logprobs": []}
        items.append(
            {
                "type": "message",
                "id": _id("msg"),
                "role": "assistant",
                "status": "completed",
                "content": [text],
            }
        )
    for call in answer.get("tool_calls") or ():
        function = call["function"]
        items.append(
            {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": call["id"],
                "name": function["name"],
                "arguments": json.dumps(function["arguments"], ensure_ascii=False),
                "status": "completed",
            }
        )
    return items


def response_object(
    body: ResponsesRequest, model: str, prompt_ids: list[int], out: GenerationOutput, answer: dict[str, Any]
) -> dict[str, Any]:
    """The Responses API's response object for one answer, with our `prompt_token_ids` and `token_ids`;
    `incomplete` when `max_output_tokens` (or the context) cut it."""
    cut = out.stop_reason == "length"
    tokens = len(out.response_ids)
    return {
        "id": _id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "instructions": body.instructions,
        "output": output_items(answer),
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "tool_choice": body.tool_choice.model_dump()
        if isinstance(body.tool_choice, NamedFunction)
        else body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "usage": {
            "input_tokens": len(prompt_ids),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(prompt_ids) + tokens,
        },
        "prompt_token_ids": prompt_ids,
        "token_ids": out.response_ids,
    }


def stream_events(response: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A finished response as the Responses API's stream events: `response.created`, each output item
    added, its text (reasoning, output text, call arguments) as one delta and done, the item done, then
    `response.completed` (or `response.incomplete`) with the whole response."""
    sequence = itertools.count()

    def event(type_: str, **fields: Any) -> dict[str, Any]:
        return {"type": type_, "sequence_number": next(sequence), **fields}

    yield event("response.created", response={**response, "status": "in_progress", "output": []})
    for index, item in enumerate(response["output"]):
        at = {"output_index": index}
        on = {"item_id": item["id"], **at}
        if item["type"] == "message":
            yield event(
                "response.output_item.added", item={**item, "status": "in_progress", "content": []}, **at
            )
            part = item["content"][0]
            yield event("response.content_part.added", content_index=0, part={**part, "text": ""}, **on)
            yield event("response.output_text.delta", content_index=0, delta=part["text"], logprobs=[], **on)
            yield event("response.output_text.done", content_index=0, text=part["text"], logprobs=[], **on)
            yield event("response.content_part.done", content_index=0, part=part, **on)
        elif item["type"] == "reasoning":
            yield event(
                "response.output_item.added", item={**item, "status": "in_progress", "content": []}, **at
            )
            part = item["content"][0]
            yield event("response.content_part.added", content_index=0, part={**part, "text": ""}, **on)
            yield event("response.reasoning_text.delta", content_index=0, delta=part["text"], **on)
            yield event("response.reasoning_text.done", content_index=0, text=part["text"], **on)
            yield event("response.content_part.done", content_index=0, part=part, **on)
        else:
            yield event(
                "response.output_item.added", item={**item, "status": "in_progress", "arguments": ""}, **at
            )
            yield event("response.function_call_arguments.delta", delta=item["arguments"], **on)
            yield event("response.function_call_arguments.done", arguments=item["arguments"], **on)
        yield event("response.output_item.done", item=item, **at)
    yield event(f"response.{response['status']}", response=response)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
