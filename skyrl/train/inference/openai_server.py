"""An OpenAI-compatible HTTP endpoint over an `InferenceEngineClient`.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses`
(OpenAI's Responses API on the chat path, `inference.responses`); with
`stream=true` the answer comes as OpenAI's server-sent events, built from the finished generation
(`openai_format.stream_chunks`: what is recorded is the same either way). Chat prompts are built with
the tokenizer's chat template, with the request's `tools`; answers carry parsed `tool_calls` (OpenAI
function calling, see `inference.tools`).
Beyond the OpenAI fields, requests may set `top_k` and `stop_token_ids`, the
`X-Session-Id` header keeps a multi-turn session on one engine, and responses
carry `prompt_token_ids` and per-choice `token_ids`, so external harnesses can
produce token-exact rollouts. A trainer that runs agents against the endpoint sets a
`SessionRecorder`, which sees (and may adjust) the requests of its sessions and records what
they generated. Every error is a JSON body
`{"error": {"message", "type", "code"}}` with a 4xx status (5xx only when an
engine fails); a malformed request never takes the server down.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from skyrl.train.inference import responses
from skyrl.train.inference.client import EngineDeadError, InferenceEngineClient
from skyrl.train.inference.config import validate_server_config
from skyrl.train.inference.engine import GenerationOutput, SamplingParams
from skyrl.train.inference.openai_format import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    chat_choice,
    completion_choice,
    events,
    reply,
    response_body,
)
from skyrl.train.inference.reasoning import Reasoning
from skyrl.train.inference.responses import ResponsesRequest
from skyrl.train.inference.tools import (
    ToolCalls,
    ToolRequestError,
    ToolUse,
    check_tool_choice,
    template_messages,
)
from skyrl.train.schema import OpenAIServerConfig

# How long an idle client connection stays open. Agents idle while the run trains; with uvicorn's
# default (5 s) the server closed pooled connections just as clients reused them (connection errors).
KEEP_ALIVE_S = 900


class APIError(Exception):
    """An error answered as an OpenAI-style JSON body with `status`."""

    def __init__(
        self, status: int, message: str, code: str | None = None, type_: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.type = status, message, code, type_


class SessionRecorder(Protocol):
    """What a trainer keeps of the sessions (`X-Session-Id`) it runs through the endpoint.

    `prepare` sees each request before it generates: for a session it runs it returns the prompt
    ids and sampling parameters to generate with (a chat request comes with `messages` in the chat
    template's form, its `tools` and `prompt_ids=None`: the recorder renders them and appends `opening`,
    the ids of a call's opening for a constrained `tool_choice`), for any other None (the request is
    served as usual); it may raise `APIError` (e.g. 409 for a session that has ended).
    `record` gets what a request of its session generated; `messages` is None for a completions
    request, `answers` are the choices as answered, assistant messages in the chat template's form.
    """

    def prepare(
        self,
        session_id: str,
        prompt_ids: list[int] | None,
        messages: list[dict[str, Any]] | None,
        params: SamplingParams,
        n: int,
        tools: list[dict[str, Any]] | None = None,
        opening: Sequence[int] = (),
    ) -> tuple[list[int], SamplingParams] | None: ...

    def record(
        self,
        session_id: str,
        prompt_ids: list[int],
        messages: list[dict[str, Any]] | None,
        outputs: list[GenerationOutput],
        answers: list[dict[str, Any]],
    ) -> None: ...


def _error_response(status: int, message: str, code: str | None, type_: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "code": code}}, status_code=status)


class OpenAIServer:
    """Serves the client's engines over HTTP on `cfg.host:cfg.port` (127.0.0.1 by default).

    `start()` runs uvicorn as a task on the running event loop, the loop the
    client is used from; `stop()` shuts it down. `url` is valid after `start()`.
    Between `pause()` and `resume()` (e.g. a weight sync, or colocated engines asleep) new requests
    wait instead of failing.
    """

    def __init__(
        self, client: InferenceEngineClient, model_path: str, cfg: OpenAIServerConfig | None = None
    ) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg or OpenAIServerConfig()
        validate_server_config(self.cfg)
        self.client = client
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model_name = self.cfg.served_model_name or str(model_path)
        self.tool_calls = ToolCalls(self.tokenizer, self.cfg.tool_parser)
        self.reasoning = Reasoning(self.tokenizer, self.cfg.reasoning_parser)
        self.app = self._build_app()
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self._open = asyncio.Event()  # cleared while paused
        self._open.set()
        self._generating = 0
        self._idle = asyncio.Event()  # set while no request is generating
        self._idle.set()
        self.port: int | None = None
        self.recorder: SessionRecorder | None = None

    @property
    def url(self) -> str:
        assert self.port is not None, "start() the server first"
        return f"http://{self.cfg.host}:{self.port}"

    async def start(self) -> None:
        """Bind and serve; returns once the socket accepts connections."""
        import uvicorn

        config = uvicorn.Config(
            self.app,
            host=self.cfg.host,
            port=self.cfg.port,
            log_level="warning",
            lifespan="off",
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the bind error
                raise RuntimeError(
                    f"the HTTP endpoint on {self.cfg.host}:{self.cfg.port} stopped while starting"
                )
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop accepting requests and wait for the server task to end."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task

    async def pause(self) -> None:
        """Hold new requests (they wait, they are not dropped) and return once the requests already
        generating have finished."""
        self._open.clear()
        await self._idle.wait()

    async def resume(self) -> None:
        """Serve the held requests and new ones again."""
        self._open.set()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="skyrl inference", docs_url=None, redoc_url=None, openapi_url=None)

        @app.middleware("http")
        async def check_api_key(request: Request, call_next):
            if self.cfg.api_key is not None:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.cfg.api_key}".encode()):
                    return _error_response(
                        401, "invalid or missing API key", "invalid_api_key", "authentication_error"
                    )
            return await call_next(request)

        @app.exception_handler(RequestValidationError)
        async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
            errors = "; ".join(
                f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                for e in exc.errors()
            )
            return _error_response(400, f"malformed request: {errors}", None, "invalid_request_error")

        @app.exception_handler(APIError)
        async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
            return _error_response(exc.status, exc.message, exc.code, exc.type)

        @app.exception_handler(Exception)
        async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
            return _error_response(500, f"{type(exc).__name__}: {exc}", None, "server_error")

        @app.get("/v1/models")
        async def models() -> dict:
            return {
                "object": "list",
                "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "skyrl"}],
            }

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request) -> Any:
            return await self._complete(body, request.headers.get("x-session-id"))

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
            return await self._chat(body, request.headers.get("x-session-id"))

        @app.post("/v1/responses")
        async def create_response(body: ResponsesRequest, request: Request) -> Any:
            return await self._respond(body, request.headers.get("x-session-id"))

        return app

    async def _complete(self, body: CompletionRequest, session_id: str | None) -> Any:
        self._check_model(body.model)
        prompt_ids = self.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        params = self._sampling_params(body, body.max_tokens, logprobs=body.logprobs is not None)
        prompt_ids, outputs, answers = await self._generate(prompt_ids, None, params, body.n, session_id)
        choices = [
            completion_choice(self.tokenizer, i, out, answer)
            for i, (out, answer) in enumerate(zip(outputs, answers, strict=True))
        ]
        return reply(body, response_body("text_completion", self.model_name, prompt_ids, outputs, choices))

    async def _chat(self, body: ChatCompletionRequest, session_id: str | None) -> Any:
        self._check_model(body.model)
        prompt_ids, outputs, answers = await self._chat_generate(body, session_id)
        choices = [
            chat_choice(self.tokenizer, i, out, answer)
            for i, (out, answer) in enumerate(zip(outputs, answers, strict=True))
        ]
        return reply(body, response_body("chat.completion", self.model_name, prompt_ids, outputs, choices))

    async def _respond(self, body: ResponsesRequest, session_id: str | None) -> Any:
        self._check_model(body.model)
        try:
            chat = responses.chat_request(body)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        prompt_ids, (out,), (answer,) = await self._chat_generate(chat, session_id)
        response = responses.response_object(body, self.model_name, prompt_ids, out, answer)
        if not body.stream:
            return response
        return StreamingResponse(
            events(responses.stream_events(response), named=True), media_type="text/event-stream"
        )

    async def _chat_generate(
        self, body: ChatCompletionRequest, session_id: str | None
    ) -> tuple[list[int], list[GenerationOutput], list[dict[str, Any]]]:
        messages, use = self._chat_request(body)
        params = self._sampling_params(
            body, body.max_completion_tokens or body.max_tokens, logprobs=body.logprobs
        )
        return await self._generate(None, messages, params, body.n, session_id, use)

    def _chat_request(self, body: ChatCompletionRequest) -> tuple[list[dict[str, Any]], ToolUse | None]:
        """The request's messages in the chat template's form and how it uses tools (None without tools
        or with `tool_choice="none"`); `APIError` 400 for inconsistent tools, tool choice or messages."""
        # `strict` asks an API for schema-constrained arguments; it is not for the model to read
        tools = [
            tool.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for tool in body.tools or ()
        ] or None
        choice = body.tool_choice
        choice = choice.model_dump() if isinstance(choice, BaseModel) else choice
        try:
            check_tool_choice(tools, choice)
            messages = template_messages([m.model_dump(exclude_none=True) for m in body.messages])
            if tools is None or choice == "none":
                return messages, None
            self.tool_calls.check(tools)
            # a named function is answered with that one call, as OpenAI does
            parallel = body.parallel_tool_calls and not isinstance(choice, dict)
            return messages, self.tool_calls.use(tools, choice, parallel)
        except ToolRequestError as exc:
            raise APIError(400, str(exc)) from exc

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                "model_not_found",
            )

    def _sampling_params(
        self, body: SamplingRequest, max_tokens: int | None, logprobs: bool
    ) -> SamplingParams:
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        try:
            return SamplingParams(
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                max_tokens=max_tokens or self.cfg.default_max_tokens,
                stop=tuple(stop),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                logprobs=logprobs,
                seed=body.seed,
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as exc:  # template errors depend on the user's messages
            raise APIError(400, f"the chat template failed on these messages: {exc}") from exc

    async def _generate(
        self,
        prompt_ids: list[int] | None,
        messages: list[dict[str, Any]] | None,
        params: SamplingParams,
        n: int,
        session_id: str | None,
        use: ToolUse | None = None,
    ) -> tuple[list[int], list[GenerationOutput], list[dict[str, Any]]]:
        """The prompt ids generated from (`messages` rendered with `use.tools` and followed by the call's
        opening when None; the rest of the call under `use.grammar`), the `n` outputs and their answers
        (assistant messages, tool calls parsed when tools were offered); the recorder sees the requests of
        its sessions before and after."""
        await self._open.wait()
        self._generating += 1
        self._idle.clear()
        try:
            tools = use.tools if use else None
            opening = self.tokenizer.encode(use.opening, add_special_tokens=False) if use else []
            if use and use.grammar:
                params = replace(params, grammar=use.grammar)
            recorder = self.recorder if session_id is not None else None
            prepared = (
                recorder.prepare(session_id, prompt_ids, messages, params, n, tools, opening)
                if recorder
                else None
            )
            if prepared is not None:
                prompt_ids, params = prepared
            elif prompt_ids is None:
                assert messages is not None
                prompt_ids = self._render(messages, tools) + opening
            outputs = list(
                await asyncio.gather(
                    *(self.client.generate(prompt_ids, params, session_id) for _ in range(n))
                )
            )
            answers = [self._answer(out, params, use, chat=messages is not None) for out in outputs]
            if prepared is not None:
                recorder.record(session_id, prompt_ids, messages, outputs, answers)
            return prompt_ids, outputs, answers
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "engine_unavailable", "server_error") from exc
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        finally:
            self._generating -= 1
            if not self._generating:
                self._idle.set()

    def _text(self, out: GenerationOutput, params: SamplingParams, skip_special_tokens: bool = True) -> str:
        text = self.tokenizer.decode(out.response_ids, skip_special_tokens=skip_special_tokens)
        # As in OpenAI's API, the matched stop string is not part of the text.
        cut = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=len(text))
        return text[:cut]

    def _answer(
        self, out: GenerationOutput, params: SamplingParams, use: ToolUse | None, chat: bool = True
    ) -> dict[str, Any]:
        """The assistant message `out` answers, in the chat template's form (for a chat request with a
        reasoning parser its thinking as `reasoning_content`; tool-call arguments as objects, no content
        key when it is only calls); a call's opening written after the prompt is part of the answer,
        which then has no thinking."""
        think = chat and not (use and use.opening)
        text = self._text(out, params)
        reasoning, text = self.reasoning.split(text) if think else (None, text)
        thought = {"reasoning_content": reasoning} if reasoning is not None else {}
        if use is None:
            return {"role": "assistant", "content": text} | thought
        raw = self._text(out, params, False)
        if think:
            raw = self.reasoning.split(raw)[1]  # calls are parsed from what the parser leaves as content
        parsed = self.tool_calls.parse(
            use.opening + raw,
            use.opening + text,
            use.tools,
            use.parallel,
            constrained=use.grammar is not None,
        )
        if not parsed.tool_calls:
            return {"role": "assistant", "content": parsed.content} | thought
        answer = {"role": "assistant", "tool_calls": parsed.tool_calls}
        return answer | ({"content": parsed.content} if parsed.content is not None else {}) | thought
