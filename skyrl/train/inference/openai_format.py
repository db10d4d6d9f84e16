"""OpenAI's wire format for the endpoint: the request bodies (validated by pydantic, so a malformed request
is a 400 naming the field), a completion's choices and body (with our `token_ids` and `prompt_token_ids`),
and the same body as server-sent stream chunks (`stream=true`), built from the finished generation."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from skyrl.train.inference.engine import GenerationOutput


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(SamplingRequest):
    """`prompt` is a string (tokenized with special tokens, as vLLM does) or a list of token ids."""

    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0)


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None  # an answer's thinking, as returned (vLLM's name; some send the other)
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


def completion_choice(
    tokenizer: Any, index: int, out: GenerationOutput, answer: dict[str, Any]
) -> dict[str, Any]:
    """A completion's choice: the answer's text with its token ids and logprobs."""
    logprobs = None
    if out.logprobs is not None:
        logprobs = {
            "tokens": tokenizer.convert_ids_to_tokens(out.response_ids),
            "token_logprobs": out.logprobs,
        }
    return {
        "index": index,
        "text": answer["content"],
        "finish_reason": out.stop_reason,
        "token_ids": out.response_ids,
        "logprobs": logprobs,
    }


def chat_choice(tokenizer: Any, index: int, out: GenerationOutput, answer: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's choice: the answer as OpenAI's message (its thinking as `reasoning` with a
    reasoning parser, tool-call arguments as JSON strings, `finish_reason` "tool_calls" when it ended in
    calls) with its token ids and logprobs."""
    logprobs = None
    if out.logprobs is not None:
        tokens = tokenizer.convert_ids_to_tokens(out.response_ids)
        logprobs = {
            "content": [
                {"token": t, "logprob": lp, "top_logprobs": []}
                for t, lp in zip(tokens, out.logprobs, strict=True)
            ]
        }
    message: dict[str, Any] = {"role": "assistant", "content": answer.get("content")}
    if "reasoning_content" in answer:
        message["reasoning"] = answer["reasoning_content"]
    calls = answer.get("tool_calls")
    if calls:
        message["tool_calls"] = [
            {
                **c,
                "function": {
                    **c["function"],
                    "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
                },
            }
            for c in calls
        ]
    return {
        "index": index,
        "message": message,
        "finish_reason": "tool_calls" if calls and out.stop_reason == "stop" else out.stop_reason,
        "token_ids": out.response_ids,
        "logprobs": logprobs,
    }


def response_body(
    kind: str, model: str, prompt_ids: list[int], outputs: list[GenerationOutput], choices: list
) -> dict[str, Any]:
    """A (chat) completion with our `prompt_token_ids` beside OpenAI's fields."""
    completion_tokens = sum(len(o.response_ids) for o in outputs)
    return {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "prompt_token_ids": prompt_ids,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        },
    }


def reply(body: SamplingRequest, response: dict[str, Any]) -> dict[str, Any] | StreamingResponse:
    """`response` as JSON, or as server-sent events for `stream=true`."""
    if not body.stream:
        return response
    usage = body.stream_options is not None and body.stream_options.include_usage
    return StreamingResponse(events(stream_chunks(response, usage)), media_type="text/event-stream")


def stream_chunks(response: dict[str, Any], include_usage: bool = False) -> Iterator[dict[str, Any]]:
    """A finished (chat) completion as OpenAI's stream chunks, choice by choice. Chat: a role chunk, the
    reasoning (with a reasoning parser), the content (with its logprobs), each tool call with its
    `index`, then a chunk with `finish_reason` (and our `token_ids`); completions: the text, then
    `finish_reason`. With `include_usage` a last chunk has the usage and no choices."""
    chat = response["object"] == "chat.completion"
    head = {key: response[key] for key in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, finish_reason: str | None = None, **fields: Any) -> dict[str, Any]:
        return head | {"choices": [{"index": index, **fields, "finish_reason": finish_reason}]}

    for choice in response["choices"]:
        index, last = choice["index"], {"token_ids": choice["token_ids"]}
        if not chat:
            yield chunk(index, text=choice["text"], logprobs=choice["logprobs"])
            yield chunk(index, choice["finish_reason"], text="", logprobs=None, **last)
            continue
        message = choice["message"]
        yield chunk(index, delta={"role": "assistant", "content": ""}, logprobs=None)
        if message.get("reasoning"):
            yield chunk(index, delta={"reasoning": message["reasoning"]}, logprobs=None)
        if message["content"]:
            yield chunk(index, delta={"content": message["content"]}, logprobs=choice["logprobs"])
        for k, call in enumerate(message.get("tool_calls") or ()):
            yield chunk(index, delta={"tool_calls": [{"index": k, **call}]}, logprobs=None)
        yield chunk(index, choice["finish_reason"], delta={}, logprobs=None, **last)
    if include_usage:
        yield head | {"choices": [], "usage": response["usage"]}


async def events(chunks: Iterator[dict[str, Any]], named: bool = False) -> AsyncIterator[str]:
    """Server-sent events of `chunks`, then `[DONE]`; `named`: each event named by its chunk's `type` and
    no `[DONE]`, as the Responses API streams. An error once the stream has started ends it with an
    `error` event (the status line is already sent)."""
    try:
        for chunk in chunks:
            yield (
                f"event: {chunk['type']}\ndata: {json.dumps(chunk)}\n\n"
                if named
                else f"data: {json.dumps(chunk)}\n\n"
            )
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"
        error = (
            {"type": "error", "message": message, "code": "server_error"}
            if named
            else {"error": {"message": message, "type": "server_error", "code": None}}
        )
        yield f"event: error\ndata: {json.dumps(error)}\n\n"
        return
    if not named:
        yield "data: [DONE]\n\n"
