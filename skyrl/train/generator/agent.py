"""Bring your own agent: episodes run by the user's agent against the run's OpenAI-compatible endpoint.

`generator.agent=package.module:function` names `agent(row, client_info) -> AgentResult` (async, or
sync and run in a thread of the `env_workers` pool). It is called once per prompt row x sample;
`client_info` holds the endpoint's `base_url`, `api_key`, `model` and a session id to send as
`X-Session-Id` (`client_info.headers`, e.g. the `openai` client's `default_headers`). The agent
calls `/v1/chat/completions` (or `/v1/completions`) as often as it likes and returns a reward:
final (on its last request) or one per request.

The endpoint records each request of a session: prompt ids, generated ids, logprobs and weight
version, one `Turn` per request. A chat request whose messages repeat the session's last request
and its answer (the assistant message as returned) and then add messages continues that context
token for token, as the rollout manager does: `previous context + generated ids + the chat
template's end of turn + the new messages`. Any other request (a harness that rewrites or trims
its history) is rendered afresh and trains as a step-wise sequence of its own
(`episode/prefix_consistent_fraction` says how many trajectories were continued throughout).

Training sessions sample with the run's `generator.sampling` (or eval sampling) and the run's action
space whatever a request asks, since the trainer's logprobs assume that distribution; a request may
lower `max_tokens` (capped at `max_generate_length` and the `max_input_length` context budget) and
set stop strings, stop token ids and a seed. An agent that raises or runs past
`generator.agent_timeout_s` fails its episode only (as an environment failure does); a session that
made no request is an empty episode (it trains nothing); a request in a session whose agent has
returned gets a 409.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from skyrl.envs.base import Message
from skyrl.train.dataset.preprocess import Trajectory, Turn
from skyrl.train.dataset.prompt_dataset import PromptRow
from skyrl.train.generator.rollout import (
    ChatTemplateDelta,
    Episode,
    GeneratorOutput,
    allowed_token_ids,
    batch_settings,
    check_failures,
    fail_turns,
    rollout_metrics,
)
from skyrl.train.inference.engine import GenerationOutput, SamplingParams
from skyrl.train.inference.openai_server import APIError, OpenAIServer
from skyrl.train.schema import EnvironmentConfig, GeneratorConfig, SamplingConfig
from skyrl.train.utils.background_loop import BackgroundLoop
from skyrl.train.utils.daemon_pool import DaemonThreadPool
from skyrl.train.utils.errors import ConfigError
from skyrl.train.utils.imports import load_entry_point

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientInfo:
    """Where an agent sends its requests: `base_url` (ending in `/v1`), `api_key` (any string when the
    endpoint needs none), `model`, and `session_id`, sent as the `X-Session-Id` header (`headers`)."""

    base_url: str
    api_key: str
    model: str
    session_id: str

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Session-Id": self.session_id}

    def openai_client(self, timeout: float = 120.0) -> Any:
        """An `openai.AsyncOpenAI` for this endpoint, shared by the episodes on the running event loop (a
        client is bound to its loop, and making one takes ~20 ms); no retries, so a failed request fails
        the episode. Send `headers` with each request (`extra_headers`): the client is not the session's."""
        return _openai_client(self.base_url, self.api_key, timeout, asyncio.get_running_loop())


@functools.lru_cache(maxsize=8)
def _openai_client(base_url: str, api_key: str, timeout: float, loop: asyncio.AbstractEventLoop) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)


@dataclass
class AgentResult:
    """What an agent returns: `reward`, final (on its last request) or a list with one reward per
    request in the order they were answered; `metrics` are logged as `env/<name>` means."""

    reward: float | list[float]
    metrics: dict[str, float] = field(default_factory=dict)


def load_agent(spec: str) -> Any:
    """The function `spec` (`package.module:function`) names; `ConfigError` naming `generator.agent`."""
    fn = load_entry_point(spec, "generator.agent")
    if not callable(fn) or inspect.isclass(fn):
        raise ConfigError(
            f"generator.agent={spec!r} is {fn!r}, not a function; give `async def agent(row, client_info)`"
        )
    return fn


@dataclass
class _Session:
    params: SamplingParams  # the run's sampling for this session; requests lower max_tokens, add stops
    turns: list[Turn] = field(default_factory=list)
    history: list[Message] | None = None  # the last chat request's messages and its answer
    tools: list[dict[str, Any]] | None = None  # the tools the last chat request offered
    last: Turn | None = None  # the turn that answered it


class AgentSessions:
    """The endpoint's `SessionRecorder` for the agent path: opens, records and closes training sessions.

    Session ids start with a prefix of this run's, so a late request of a closed session is told
    so (409) instead of being served untracked.
    """

    def __init__(self, tokenizer: Any, max_input_length: int) -> None:
        self.template = ChatTemplateDelta(tokenizer)
        self.max_input_length = max_input_length
        self.prefix = f"skyrl-{uuid.uuid4().hex[:12]}-"
        self._ids = itertools.count()
        self._open: dict[str, _Session] = {}

    def open(self, trajectory_id: str, params: SamplingParams) -> str:
        session_id = f"{self.prefix}{next(self._ids)}-{trajectory_id}"
        self._open[session_id] = _Session(params)
        return session_id

    def close(self, session_id: str) -> list[Turn]:
        """The session's turns, in the order they were answered; later requests get a 409."""
        return self._open.pop(session_id).turns

    def _session(self, session_id: str) -> _Session | None:
        if not session_id.startswith(self.prefix):
            return None  # not a training session: served as any request
        session = self._open.get(session_id)
        if session is None:
            raise APIError(
                409,
                f"session {session_id!r} has ended (its agent returned or timed out); the run no longer "
                "records it, so this request would not be trained on",
                "session_closed",
            )
        return session

    def prepare(
        self,
        session_id: str,
        prompt_ids: list[int] | None,
        messages: list[Message] | None,
        params: SamplingParams,
        n: int,
        tools: list[dict[str, Any]] | None = None,
        opening: Sequence[int] = (),
    ) -> tuple[list[int], SamplingParams] | None:
        session = self._session(session_id)
        if session is None:
            return None
        if n != 1:
            raise APIError(400, f"n={n}: a training session records one answer per request; send n=1")
        if prompt_ids is None:
            assert messages is not None, "a chat request comes with its messages"
            prompt_ids = self._chat_prompt(session, messages, tools) + list(opening)
        budget = self.max_input_length - len(prompt_ids)
        if budget < 1:
            raise APIError(
                400,
                f"the context is {len(prompt_ids)} tokens, the run's limit generator.max_input_length="
                f"{self.max_input_length} leaves no room to generate",
                "context_length_exceeded",
            )
        return prompt_ids, replace(
            session.params,
            max_tokens=min(params.max_tokens, session.params.max_tokens, budget),
            stop=params.stop,
            stop_token_ids=params.stop_token_ids,
            seed=params.seed,
            grammar=params.grammar,
        )

    def _chat_prompt(
        self, session: _Session, messages: list[Message], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """The session's context continued token for token when `messages` extend its last request and
        answer with the same `tools` (with tools, also only where the template renders that history as
        the text recorded: a template may rewrite earlier turns, e.g. a tool call's JSON), else
        `messages` rendered afresh."""
        history, last = session.history, session.last
        continued = history is not None and last is not None and session.tools == tools
        session.tools = tools
        try:
            if continued and messages[: len(history)] == history:
                recorded = last.context_ids + last.response_ids + self.template.close_turn(last.response_ids)
                if not tools or self._decode(self.template.history(history, tools)) == self._decode(recorded):
                    return recorded + self.template.observation(messages[len(history) :])
            return self.template.prompt(messages, tools)
        except Exception as exc:  # template errors depend on the agent's messages
            raise APIError(400, f"the chat template failed on these messages: {exc}") from exc

    def _decode(self, ids: list[int]) -> str:
        return self.template.tokenizer.decode(ids, skip_special_tokens=False)

    def record(
        self,
        session_id: str,
        prompt_ids: list[int],
        messages: list[Message] | None,
        outputs: list[GenerationOutput],
        answers: list[dict[str, Any]],
    ) -> None:
        session = self._session(session_id)
        if session is None:
            return
        (out,), (answer,) = outputs, answers
        if not out.response_ids:  # aborted: nothing generated
            return
        turn = Turn(
            list(prompt_ids),
            list(out.response_ids),
            list(out.logprobs or []),
            [1] * len(out.response_ids),
            0.0,
            out.weight_version,
        )
        session.turns.append(turn)
        if messages is not None:
            session.history = [*messages, answer]
            session.last = turn


class AgentGenerator:
    """Episodes of prompts x samples, each run by `generator.agent` through `server` (see the module
    docstring). `cfg` is the `generator` section, `env` the `environment` section (its action space
    applies to the sessions)."""

    def __init__(
        self, server: OpenAIServer, tokenizer: Any, cfg: GeneratorConfig, env: EnvironmentConfig
    ) -> None:
        assert cfg.agent is not None, "generator.agent names the agent"
        self.server, self.tokenizer, self.cfg, self.env = server, tokenizer, cfg, env
        self.agent = load_agent(cfg.agent)
        self.allowed_token_ids = allowed_token_ids(tokenizer, env)
        self.sessions = AgentSessions(tokenizer, cfg.max_input_length)
        server.recorder = self.sessions
        self._agents = BackgroundLoop("skyrl-agent-loop")

    async def agenerate(
        self,
        prompts: list[PromptRow],
        uids: list[str] | None = None,
        sampling: SamplingConfig | None = None,
        n_samples_per_prompt: int | None = None,
    ) -> GeneratorOutput:
        """Episodes for every prompt x sample in prompt order, as `RolloutManager.agenerate`."""
        uids, sampling, n = batch_settings(self.cfg, prompts, uids, sampling, n_samples_per_prompt)
        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=self.cfg.max_generate_length,
            allowed_token_ids=self.allowed_token_ids,
        )
        start, parse_failures = time.perf_counter(), self.server.tool_calls.parse_failures
        # not a `with` block: a sync agent stuck past its timeout must not hold up the batch, and daemon
        # threads: nor the process's exit
        pool = DaemonThreadPool(self.cfg.env_workers, "skyrl-agent")
        try:
            episodes = list(
                await asyncio.gather(
                    *(
                        self._episode(row, uid, f"{uid}/{s}", pool, params)
                        for row, uid in zip(prompts, uids, strict=True)
                        for s in range(n)
                    )
                )
            )
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        check_failures(episodes, self.cfg.max_env_failure_fraction)
        if all(e.stop_reason == "empty" for e in episodes):
            logger.warning(
                "generator.agent=%s made no request in any of its %d sessions, so nothing trains; send "
                "client_info.headers (the X-Session-Id header) with every request to client_info.base_url",
                self.cfg.agent,
                len(episodes),
            )
        parse_failures = self.server.tool_calls.parse_failures - parse_failures
        return GeneratorOutput(
            episodes, rollout_metrics(episodes, n, time.perf_counter() - start, parse_failures)
        )

    async def _episode(
        self, row: PromptRow, uid: str, trajectory_id: str, pool: DaemonThreadPool, params: SamplingParams
    ) -> Episode:
        session_id = self.sessions.open(trajectory_id, params)
        cfg = self.server.cfg
        info = ClientInfo(f"{self.server.url}/v1", cfg.api_key or "none", self.server.model_name, session_id)
        deadline = asyncio.timeout(self.cfg.agent_timeout_s)
        try:
            async with deadline:
                result = await self._call(row, info, pool)
            error = None
        except Exception as e:  # the agent's bug (or its slowness) ends its episode only
            result = None
            error = (
                f"the agent timed out after generator.agent_timeout_s={self.cfg.agent_timeout_s}"
                if deadline.expired()
                else f"the agent raised {type(e).__name__}: {e}"
            )
        finally:
            turns = self.sessions.close(session_id)
            self.server.client.end_session(session_id)
        if error is None:
            try:
                rewards = turn_rewards(result, len(turns))
            except ValueError as e:
                error = str(e)
        if error is not None:
            fail_turns(turns, self.cfg.env_failure)
            return Episode(
                Trajectory(uid, trajectory_id, turns or self._placeholder(row)), "error", 0.0, error
            )
        metrics = dict(result.metrics) if isinstance(result, AgentResult) else {}
        if not turns:  # the model answered nothing, so nothing is trained and the episode scores 0
            return Episode(
                Trajectory(uid, trajectory_id, self._placeholder(row)), "empty", 0.0, None, metrics
            )
        for turn, reward in zip(turns, rewards, strict=True):
            turn.reward = reward
        return Episode(Trajectory(uid, trajectory_id, turns), "done", sum(rewards), None, metrics)

    def _call(self, row: PromptRow, info: ClientInfo, pool: DaemonThreadPool) -> asyncio.Future:
        """The agent's call: an async agent on the agents' own loop (one that blocks it stalls the agents,
        not the endpoint), a sync one in the pool."""
        if inspect.iscoroutinefunction(self.agent):
            coro = self.agent(row, info)
            return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._agents.loop))
        return asyncio.wrap_future(pool.submit_as(self.cfg.agent, functools.partial(self.agent, row, info)))

    def close(self) -> None:
        """Stop the agents' loop (cancelling what still runs on it)."""
        self._agents.close()

    def _placeholder(self, row: PromptRow) -> list[Turn]:
        return self.sessions.template.placeholder(row.prompt, self.server.client.weight_version)


def turn_rewards(result: Any, num_turns: int) -> list[float]:
    """Per recorded request, its reward: a final reward goes to the last one. `result` is an
    `AgentResult` or a bare number; `ValueError` naming what is wrong otherwise."""
    reward = result.reward if isinstance(result, AgentResult) else result
    if isinstance(reward, (list, tuple)):
        if len(reward) != num_turns or not all(isinstance(r, (int, float)) for r in reward):
            raise ValueError(
                f"the agent returned {len(reward)} per-request rewards for {num_turns} recorded requests; "
                "give one number per request, or a single final reward"
            )
        return [float(r) for r in reward]
    if not isinstance(reward, (int, float)) or isinstance(reward, bool):
        raise ValueError(
            f"the agent returned {result!r}; return an AgentResult(reward=...) or a number (the final reward)"
        )
    return [0.0] * (num_turns - 1) + [float(reward)] if num_turns else []
