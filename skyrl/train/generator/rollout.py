"""The multi-turn rollout manager: episodes of prompts x samples against environments, token-exact.

Per episode: the env builds the first messages (`init`), the tokenizer's chat
template renders them once, then each turn the engine generates from the exact
context ids, the env `step`s on the decoded text, and the observation tokens are
the chat-template delta of the appended messages (generation prompt included):

    context_{k+1} = context_k + response_k (the engine's own ids) + observation_k

Observation tokens are never trained on (loss mask 0); the response keeps the
engine's token ids, never re-tokenised. An env that raises, or whose call does not return within
`environment.timeout_s`, ends only its episode (reward 0, error recorded, counted in
`episode/env_failures`); with
`generator.env_failure=mask` (the default) its turns also get loss mask 0, so the
policy is not trained on the environment's bug. The batch fails only above
`max_env_failure_fraction`.

Env calls run on `generator.env_executor`: `thread` (the default), a pool of `env_workers` threads per
batch (a call stuck past its timeout leaves its thread behind); or `process`, the manager's
`EnvProcessPool` of `env_workers` worker processes, kept across batches until `close`, where an env
that segfaults, exits or hangs ends only the episodes whose envs share its process (a call past its
timeout kills its process, and with it those episodes) and a new process takes its place.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import statistics
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from skyrl.envs import BaseTextEnv, make, resolve
from skyrl.envs.base import ToolCall
from skyrl.train.dataset.preprocess import Trajectory, Turn, prefix_consistent
from skyrl.train.dataset.prompt_dataset import PromptRow
from skyrl.train.generator.env_processes import EnvFailure, EnvProcessPool, RemoteEnv
from skyrl.train.inference.engine import GenerationOutput, SamplingParams
from skyrl.train.inference.reasoning import Reasoning
from skyrl.train.inference.tools import PARSER_KEY, ToolCalls
from skyrl.train.schema import EnvironmentConfig, GeneratorConfig, SamplingConfig
from skyrl.train.utils.background_loop import run_in_new_loop
from skyrl.train.utils.daemon_pool import DaemonThreadPool
from skyrl.train.utils.errors import ConfigError

logger = logging.getLogger(__name__)


def allowed_token_ids(tokenizer: Any, env: EnvironmentConfig) -> tuple[int, ...]:
    """Token ids of the action space of `env.env_class` (`environment.config.<env_class>.allowed_tokens`;
    empty: no restriction); `ConfigError` unless each entry is exactly one token."""
    key = f"environment.config.{env.env_class}.allowed_tokens"
    tokens = (env.config.get(env.env_class) or {}).get("allowed_tokens") or []
    ids = []
    for text in tokens:
        encoded = tokenizer.encode(str(text), add_special_tokens=False)
        if len(encoded) != 1:
            raise ConfigError(
                f"{key} entry {text!r} is {len(encoded)} tokens for this tokenizer; each entry must be "
                f"exactly one token (or set {key}=null)"
            )
        ids += encoded
    return tuple(ids)


@dataclass
class Episode:
    """One finished episode: its trajectory, how it ended and its reward (the sum of its turns')."""

    trajectory: Trajectory
    stop_reason: str  # done | max_turns | length | error | abort
    reward: float
    error: str | None = None
    env_metrics: dict[str, float] = field(default_factory=dict)
    row: PromptRow | None = None  # the prompt it answered (set by `generate_checked`)
    scores: dict[str, float] = field(default_factory=dict)  # each reward source's (`skyrl.train.rewards`)

    @property
    def num_turns(self) -> int:
        return sum(1 for t in self.trajectory.turns if any(t.loss_mask))


@dataclass
class GeneratorOutput:
    episodes: list[Episode]
    metrics: dict[str, float]

    @property
    def trajectories(self) -> list[Trajectory]:
        return [e.trajectory for e in self.episodes]


class ChatTemplateDelta:
    """Token ids the chat template puts between turns, computed once per tokenizer.

    `observation(messages)` is what follows a finished assistant turn: the appended
    messages and the generation prompt. `close_turn(response)` is what must follow
    a response to finish the assistant turn as the template writes it (the rest of
    the end-of-turn suffix after an eos, or the whole suffix when generation was cut).
    Renders are cached by message content (a prompt's samples, and environments' recurring
    observations, render once), up to `CACHE_SIZE` entries.
    """

    BASE = ({"role": "user", "content": "x"}, {"role": "assistant", "content": "y"})
    CACHE_SIZE = 4096

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: OrderedDict[tuple, list[int]] = OrderedDict()
        base = self._render(list(self.BASE), add_generation_prompt=False)
        eos = tokenizer.eos_token_id
        if eos not in base:
            raise ValueError(
                f"the chat template does not end assistant turns with the eos token {tokenizer.eos_token!r}; "
                "multi-turn token-exact rollouts need it"
            )
        self.eos = eos
        self.base_length = len(base)
        self.turn_suffix = base[len(base) - base[::-1].index(eos) - 1 :]  # eos and what follows it

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        try:
            key = (add_generation_prompt, *(tuple(sorted(m.items())) for m in messages))
            hash(key)
        except TypeError:  # e.g. a list of content parts or tool calls: rendered every time
            key = None
        if tools:
            key = None
        if key in self._cache:
            self._cache.move_to_end(key)
            return list(self._cache[key])
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if key is not None:
            self._cache[key] = ids
            if len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        return list(ids)

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self._render(messages, add_generation_prompt=True, tools=tools)

    def history(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """`messages` as the template renders a finished conversation (no generation prompt)."""
        return self._render(messages, add_generation_prompt=False, tools=tools)

    def close_turn(self, response_ids: list[int]) -> list[int]:
        return self.turn_suffix[1:] if response_ids and response_ids[-1] == self.eos else self.turn_suffix

    def observation(self, messages: list[dict[str, str]]) -> list[int]:
        return self._render([*self.BASE, *messages], add_generation_prompt=True)[self.base_length :]

    def placeholder(self, messages: list[dict[str, str]], weight_version: int) -> list[Turn]:
        """The one turn of an episode that produced no response: trains nothing (loss mask 0)."""
        return [Turn(self.prompt(messages), [self.eos], [0.0], [0], 0.0, weight_version)]


class RolloutManager:
    """Runs `n_samples_per_prompt` episodes per prompt concurrently against an engine client.

    `cfg` is the `generator` section (its `inference_engine` part belongs to the engines),
    `env` the `environment` section. `ConfigError` if an entry of the env's `allowed_tokens` is not one token.
    With `env_executor=process`, `close` stops the env processes (a later batch starts new ones).
    """

    def __init__(self, client: Any, tokenizer: Any, cfg: GeneratorConfig, env: EnvironmentConfig):
        self.client, self.tokenizer, self.cfg, self.env = client, tokenizer, cfg, env
        self.template = ChatTemplateDelta(tokenizer)
        self.allowed_token_ids = allowed_token_ids(tokenizer, env)
        # an env sees what an agent would: the content the reasoning parser leaves, the calls parsed from it
        self.tool_calls = ToolCalls(tokenizer, cfg.http_endpoint.tool_parser)
        self.reasoning = Reasoning(tokenizer, cfg.http_endpoint.reasoning_parser)
        self._processes: EnvProcessPool | None = None  # started by the first batch that needs it
        self._env_classes: dict[str, type[BaseTextEnv]] = {}  # what a thread's `make` built, by name

    def close(self) -> None:
        """Stop the env processes, if any (their calls in flight fail)."""
        if self._processes is not None:
            self._processes.close()
            self._processes = None

    def _sampling(self, context_length: int, sampling: SamplingConfig) -> SamplingParams:
        budget = min(self.cfg.max_generate_length, self.cfg.max_input_length - context_length)
        return SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=budget,
            allowed_token_ids=self.allowed_token_ids,
        )

    def generate(
        self,
        prompts: list[PromptRow],
        uids: list[str] | None = None,
        sampling: SamplingConfig | None = None,
        n_samples_per_prompt: int | None = None,
    ) -> GeneratorOutput:
        """Episodes for every prompt x sample, grouped by prompt; see `agenerate`."""
        return run_in_new_loop(self.agenerate(prompts, uids, sampling, n_samples_per_prompt))

    async def agenerate(
        self,
        prompts: list[PromptRow],
        uids: list[str] | None = None,
        sampling: SamplingConfig | None = None,
        n_samples_per_prompt: int | None = None,
    ) -> GeneratorOutput:
        """Episodes for every prompt x sample, in prompt order (the samples of a prompt contiguous).

        `uids[i]` names prompt i's group (default `p{i}`); trajectory ids are `uid/sample`.
        `sampling` and `n_samples_per_prompt` default to the section's (eval passes its own).
        Raises `RuntimeError` quoting the first errors when more than
        `max_env_failure_fraction` of the episodes failed in their environment.
        """
        uids, sampling, n = batch_settings(self.cfg, prompts, uids, sampling, n_samples_per_prompt)
        start, parse_failures = time.perf_counter(), self.tool_calls.parse_failures
        pool = self._env_executor()
        waiting = _Waiting(self.client, len(prompts) * n)
        try:
            # a TaskGroup cancels and awaits every episode if one raises (e.g. a dead engine)
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(self._episode(row, uid, f"{uid}/{s}", pool, sampling, waiting))
                    for row, uid in zip(prompts, uids, strict=True)
                    for s in range(n)
                ]
        except ExceptionGroup as errors:
            raise errors.exceptions[0] from None
        finally:
            if isinstance(pool, DaemonThreadPool):
                pool.shutdown(wait=False, cancel_futures=True)
        episodes = [task.result() for task in tasks]
        check_failures(episodes, self.cfg.max_env_failure_fraction)
        parse_failures = self.tool_calls.parse_failures - parse_failures
        return GeneratorOutput(
            episodes, rollout_metrics(episodes, n, time.perf_counter() - start, parse_failures)
        )

    def _env_executor(self) -> DaemonThreadPool | EnvProcessPool:
        """This batch's env threads, or the manager's env processes (kept across batches: a process
        starts in about 0.1 s plus its env's imports)."""
        if self.cfg.env_executor == "thread":
            # not a `with` block: an env call stuck past its timeout must not hold up the batch, and daemon
            # threads: nor the process's exit
            return DaemonThreadPool(self.cfg.env_workers, "skyrl-env")
        if self._processes is None:
            self._processes = EnvProcessPool(self.cfg.env_workers)
        return self._processes

    async def _env_call(
        self,
        pool: DaemonThreadPool | EnvProcessPool,
        env: BaseTextEnv | RemoteEnv | None,
        method: str,
        *args: Any,
    ) -> Any:
        """`env.<method>(*args)`, or with `env=None` and `method="make"` a new env (`make(*args)`), in a
        thread of `pool` or in the process that hosts the env (a method a thread-hosted env inherits from
        `BaseTextEnv` runs inline: it returns at once; so does building a thread-hosted env whose class
        has `BaseTextEnv`'s constructor, once a thread has built one). Anything it raises, and not
        returning within `environment.timeout_s`, becomes an `EnvFailure`: a stuck thread is left behind;
        a stuck process is killed (failing the episodes of its other envs too) and later replaced."""
        if isinstance(env, BaseTextEnv) and getattr(type(env), method) is getattr(BaseTextEnv, method):
            return getattr(env, method)(*args)  # BaseTextEnv's own default returns at once: no thread hop
        built = self._env_classes.get(args[0]) if env is None else None
        if built is not None:  # so does its constructor, once a thread's `make` has imported the class
            try:
                if resolve(args[0]) is built and _base_constructor(built):
                    return built(*args[1:])
            except Exception as e:
                raise EnvFailure(f"make({args[0]}) raised {type(e).__name__}: {e}") from e
        if isinstance(pool, EnvProcessPool):
            name = "make" if env is None else getattr(env.cls, method).__qualname__
            future = pool.make(*args) if env is None else pool.call(env, method, *args)
        else:
            fn = make if env is None else getattr(env, method)
            name = f"make({args[0]})" if env is None else fn.__qualname__
            future = pool.submit_as(name, functools.partial(fn, *args))
        deadline = asyncio.timeout(self.env.timeout_s)
        try:
            async with deadline:
                result = await asyncio.wrap_future(future)
        except Exception as e:
            if deadline.expired():
                message = f"{name} did not return within environment.timeout_s={self.env.timeout_s}"
                if isinstance(pool, EnvProcessPool):
                    pool.kill(future, message)
                raise EnvFailure(message) from e
            if isinstance(pool, EnvProcessPool):
                raise  # the pool's EnvFailure names the call already
            raise EnvFailure(f"{name} raised {type(e).__name__}: {e}") from e
        if env is None and isinstance(result, BaseTextEnv):
            self._env_classes[args[0]] = type(result)
        return result

    async def _episode(
        self,
        row: PromptRow,
        uid: str,
        trajectory_id: str,
        pool: DaemonThreadPool | EnvProcessPool,
        sampling: SamplingConfig,
        waiting: _Waiting,
    ) -> Episode:
        env_class = row.env_class or self.env.env_class
        turns: list[Turn] = []
        env: BaseTextEnv | RemoteEnv | None = None
        try:
            env = await self._env_call(
                pool, None, "make", env_class, self.env.config.get(env_class, {}), row.extras
            )
            context, tools = await self._prompt(pool, env, env_class, row)
            stop_reason, total = "max_turns", 0.0
            for _ in range(self.cfg.max_turns):
                if len(context) >= self.cfg.max_input_length:
                    stop_reason = "length"
                    break
                out = await waiting.generate(context, self._sampling(len(context), sampling), trajectory_id)
                if out.stop_reason == "abort":
                    stop_reason = "abort"
                    break
                response = list(out.response_ids)
                step = await self._step(pool, env, response, tools)
                logprobs, mask = list(out.logprobs), [1] * len(response)
                turns.append(
                    Turn(list(context), response, logprobs, mask, float(step.reward), out.weight_version)
                )
                total += float(step.reward)
                if step.done:
                    stop_reason = "done"
                    break
                context = context + response + self.template.close_turn(response)
                context += self.template.observation(step.observations)
            metrics = await self._env_call(pool, env, "get_metrics")
            return Episode(
                Trajectory(uid, trajectory_id, turns or self._placeholder(row)),
                stop_reason,
                total,
                None,
                metrics,
            )
        except EnvFailure as e:  # ends this episode only, scored 0
            fail_turns(turns, self.cfg.env_failure)
            return Episode(
                Trajectory(uid, trajectory_id, turns or self._placeholder(row)), "error", 0.0, str(e)
            )
        finally:
            waiting.ended()
            self.client.end_session(trajectory_id)
            if env is not None:
                try:
                    await self._env_call(pool, env, "close")
                except EnvFailure as e:
                    logger.warning("episode %s: %s", trajectory_id, e)

    async def _prompt(
        self,
        pool: DaemonThreadPool | EnvProcessPool,
        env: BaseTextEnv | RemoteEnv,
        env_class: str,
        row: PromptRow,
    ) -> tuple[list[int], list[dict[str, Any]] | None]:
        """The episode's first context (the env's `init` messages, with its tools) and its tools."""
        messages, _ = await self._env_call(pool, env, "init", row.prompt)
        tools = await self._env_call(pool, env, "tools")
        if tools and self.tool_calls.name is None:
            raise ConfigError(
                f"environment {env_class!r} declares tools, but {PARSER_KEY}={self.tool_calls.requested!r} "
                "parses no tool calls for this model (its chat template writes no tool-call tags, or vLLM is "
                "missing); set the parser, e.g. hermes for Qwen2.5"
            )
        return self.template.prompt(messages, tools), tools

    async def _step(
        self,
        pool: DaemonThreadPool | EnvProcessPool,
        env: BaseTextEnv | RemoteEnv,
        response: list[int],
        tools: list[dict[str, Any]] | None,
    ) -> Any:
        """The env's step on `response`'s text, without the thinking a reasoning parser splits off (and,
        for an env with tools, its calls as the endpoint parses them, arguments as objects)."""
        text = self.reasoning.split(self.tokenizer.decode(response, skip_special_tokens=True))[1]
        if not tools:
            return await self._env_call(pool, env, "step", text)
        raw = self.reasoning.split(self.tokenizer.decode(response, skip_special_tokens=False))[1]
        calls: list[ToolCall] = self.tool_calls.parse(raw, text, tools, parallel=True).tool_calls
        return await self._env_call(pool, env, "step", text, calls)

    def _placeholder(self, row: PromptRow) -> list[Turn]:
        return self.template.placeholder(row.prompt, self.client.weight_version)


class _Waiting:
    """A batch's running episodes and how many of them wait for the engines. Once all that run wait, no
    request comes until outputs return: the engines are told to start what they hold
    (`InferenceEngineClient.flush`) instead of waiting for more."""

    def __init__(self, client: Any, running: int):
        self.client, self.running, self.waiting = client, running, 0

    async def generate(self, context: list[int], params: SamplingParams, session_id: str) -> GenerationOutput:
        self.waiting += 1
        try:
            return await self.client.generate(
                context, params, session_id=session_id, flush=self.waiting == self.running
            )
        finally:
            self.waiting -= 1

    def ended(self) -> None:
        self.running -= 1
        if self.waiting and self.waiting == self.running:
            self.client.flush()


def _base_constructor(cls: type) -> bool:
    """Whether building `cls` runs only `BaseTextEnv`'s own constructor (nothing of the env's: no
    `__init__`, `__new__` or metaclass of its own)."""
    return (
        cls.__init__ is BaseTextEnv.__init__
        and cls.__new__ is BaseTextEnv.__new__
        and type(cls) is type(BaseTextEnv)
    )


def batch_settings(
    cfg: GeneratorConfig,
    prompts: list[PromptRow],
    uids: list[str] | None,
    sampling: SamplingConfig | None,
    n_samples_per_prompt: int | None,
) -> tuple[list[str], SamplingConfig, int]:
    """A generator call's uids (default `p{i}`), sampling and samples per prompt (default the section's)."""
    return (
        uids or [f"p{i}" for i in range(len(prompts))],
        sampling or cfg.sampling,
        n_samples_per_prompt or cfg.n_samples_per_prompt,
    )


def fail_turns(turns: list[Turn], env_failure: str) -> None:
    """The turns of a failed episode: reward 0, and with `env_failure="mask"` loss mask 0."""
    for turn in turns:
        turn.reward = 0.0
        if env_failure == "mask":
            turn.loss_mask = [0] * len(turn.loss_mask)


def check_failures(episodes: list[Episode], max_fraction: float) -> None:
    """`RuntimeError` quoting the first errors when more than `max_fraction` of the episodes failed."""
    failures = [e for e in episodes if e.stop_reason == "error"]
    if len(failures) > max_fraction * len(episodes):
        quoted = "; ".join(f"{e.trajectory.trajectory_id}: {e.error}" for e in failures[:3])
        raise RuntimeError(
            f"{len(failures)} of {len(episodes)} episodes failed in their environment, agent or a reward source (more than "
            f"generator.max_env_failure_fraction={max_fraction}); first errors: {quoted}"
        )


def rollout_metrics(
    episodes: list[Episode], n_samples_per_prompt: int, seconds: float, tool_parse_failures: int = 0
) -> dict[str, float]:
    """Reward statistics, pass@n, turns, response lengths, stop reasons, env failures and metrics, the
    share of trajectories whose every context extends the one before (`prefix_consistent`), the answers
    whose tool-call tags did not parse as calls (answered as plain text), timing."""
    rewards = [e.reward for e in episodes]
    groups = [rewards[i : i + n_samples_per_prompt] for i in range(0, len(rewards), n_samples_per_prompt)]
    response_tokens = [
        sum(len(t.response_ids) for t in e.trajectory.turns if any(t.loss_mask)) for e in episodes
    ]
    metrics = {
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        f"reward/pass@{n_samples_per_prompt}": statistics.fmean(max(g) > 0 for g in groups),
        "episode/turns": statistics.fmean(e.num_turns for e in episodes),
        "episode/response_tokens_mean": statistics.fmean(response_tokens),
        "episode/response_tokens_max": float(max(response_tokens)),
        "episode/env_failures": float(sum(e.stop_reason == "error" for e in episodes)),
        "agent/tool_parse_failures": float(tool_parse_failures),
        "episode/prefix_consistent_fraction": statistics.fmean(
            prefix_consistent(e.trajectory) for e in episodes
        ),
        "timing/generate_s": seconds,
    }
    for reason, count in Counter(e.stop_reason for e in episodes).items():
        metrics[f"episode/stop_{reason}"] = count / len(episodes)
    env_keys = {k for e in episodes for k in e.env_metrics}
    for key in sorted(env_keys):
        values = [e.env_metrics[key] for e in episodes if key in e.env_metrics]
        metrics[f"env/{key}"] = statistics.fmean(values) if values else math.nan
    return metrics
