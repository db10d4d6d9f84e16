"""Rewards beyond the environment: the sources of `reward.sources`, combined into what an episode trains on.

Each source `reward.sources.<name>` has a `type` and a `weight`:
- `env`: the environment's (or the agent's) rewards, per turn as it gave them (the default source);
- `function`: a scorer of finished responses. `function: pkg.module:fn` is called with a list of
  `RewardInput`s and returns one score each (a sync function runs in a thread; an async one on the
  run's loop); `url` POSTs `{"inputs": [...]}` (the same fields as JSON) and reads `{"rewards": [...]}`;
- `judge`: an LLM asked to rate each response through an OpenAI-compatible chat completions endpoint
  (`url`, `model`) or engines of its own (`engine`): the prompt is `template` filled with the row's
  prompt, the response, the context and the row's columns (`JUDGE_TEMPLATE`, a 0-10 rating, by
  default), the score the first match of `score_pattern` in the answer (or `function`'s parse of it);
  `concurrency` requests at a time.
HTTP calls are retried `max_retries` times on connection errors and 5xx answers; each call gets
`timeout_s`.

A scorer scores an episode's last turn in its full context (what the model saw, then its response), or
with `per_turn` each turn. Its scores may be standardised by their running mean and std over the run
(`normalize`; the statistics are part of the sampler's checkpointed state, updated by training batches
only) and then bounded (`clip`). A turn then trains on `w_env * env reward + sum of w * score` over the
scorers that scored it, and the episode's reward is the sum over its turns, so dynamic sampling, the
advantages and `reward/mean` all see the combined reward.

A scorer that raises, runs past its timeout or gives a score that is not a finite number (a judge: an
answer without a score) fails the episodes it was scoring as an environment failure does
(`generator.env_failure`), counted as `reward/<name>_failures`; `reward/<name>_mean` and `_std` describe the scores it gave (before
normalising). Episodes that had already failed are not scored.
"""

from __future__ import annotations

import asyncio
import http.client
import inspect
import json
import math
import numbers
import os
import re
import statistics
import string
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, fields
from typing import Any

from skyrl.train.cluster import WorkerGroups, resolve_model_path
from skyrl.train.dataset.preprocess import TrainingSequence, collate_sequences
from skyrl.train.generator.rollout import Episode, fail_turns
from skyrl.train.inference import InferenceEngineClient
from skyrl.train.inference.config import validate_engine_config
from skyrl.train.inference.engine import SamplingParams
from skyrl.train.schema import (
    REWARD_TYPES,
    InferenceEngineConfig,
    RewardConfig,
    RewardSourceConfig,
    TrainerConfig,
)
from skyrl.train.utils.errors import ConfigError
from skyrl.train.utils.imports import load_entry_point
from skyrl.train.workers.actor_group import WorkerDiedError

NAME = re.compile(r"[A-Za-z0-9_]+")
JUDGE_TEMPLATE = (
    "Rate how well the response answers the request, from 0 (not at all) to 10 (perfectly). "
    "Answer with the number only.\n\nRequest:\n{prompt}\n\nResponse:\n{response}"
)
SCORING = {"type", "weight", "per_turn", "normalize", "clip"}
HTTP = {"url", "timeout_s", "max_retries"}
# the settings each type of source takes
FIELDS = {
    "env": {"type", "weight"},
    "function": SCORING | HTTP | {"function"},
    "judge": SCORING
    | HTTP
    | {"model", "template", "score_pattern", "function", "temperature", "max_tokens", "concurrency"}
    | {"api_key_env", "engine"},
    "model": SCORING | {"model", "num_nodes", "num_gpus_per_node", "sequence_parallel_size"},
}


@dataclass
class RewardInput:
    """One response a scorer scores: the prompt's `uid`, the episode's `trajectory_id`, the scored
    `turn` (its index in the episode), the dataset row's `prompt` messages and other columns (`extras`,
    e.g. a reference answer), the `context` the model saw (decoded with the chat template's special
    tokens), the `response` it generated (decoded without them), the environment's reward for it
    (`env_reward`: the episode's total, or the turn's with `per_turn`), and the token ids of both."""

    uid: str
    trajectory_id: str
    turn: int
    prompt: list[dict[str, Any]]
    extras: dict[str, Any]
    context: str
    response: str
    env_reward: float
    context_ids: list[int]
    response_ids: list[int]


def source_configs(cfg: RewardConfig) -> dict[str, RewardSourceConfig]:
    """The sources of `reward.sources` as configs; `ConfigError` naming the key for a source that is not a
    mapping of `RewardSourceConfig` fields, or has a field of the wrong kind."""
    known = {f.name for f in fields(RewardSourceConfig)}
    sources = {}
    for name, source in cfg.sources.items():
        key = f"reward.sources.{name}"
        if isinstance(source, RewardSourceConfig):
            sources[name] = source
            continue
        if not isinstance(source, dict):
            raise ConfigError(
                f"{key}={source!r} must be a mapping, e.g. {key}={{type: function, function: pkg.mod:fn}}"
            )
        unknown = sorted(set(source) - known)
        if unknown:
            raise ConfigError(f"{key} has no field {unknown[0]!r}; its fields are {sorted(known)}")
        try:
            made = RewardSourceConfig(**source)
            made.weight, made.timeout_s = float(made.weight), float(made.timeout_s)
            made.temperature, made.clip = (
                float(made.temperature),
                None if made.clip is None else float(made.clip),
            )
            made.max_retries, made.max_tokens, made.concurrency = (
                int(made.max_retries),
                int(made.max_tokens),
                int(made.concurrency),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{key}: {exc}") from None
        sources[name] = made
    return sources


def validate_rewards(cfg: RewardConfig) -> None:
    """`ConfigError` naming the key, the value and a valid alternative for a source that cannot score."""
    sources = source_configs(cfg)
    if not sources:
        raise ConfigError(
            "reward.sources is empty: nothing would reward the policy; e.g. reward.sources.env.weight=1"
        )
    envs = [name for name, s in sources.items() if s.type == "env"]
    if len(envs) > 1:
        raise ConfigError(f"reward.sources {envs} are all of type env; the environment's rewards count once")
    for name, source in sources.items():
        key = f"reward.sources.{name}"
        if not NAME.fullmatch(name):
            raise ConfigError(f"{key}: a source's name names its metrics, so letters, digits and _ only")
        if source.type not in REWARD_TYPES:
            raise ConfigError(f"{key}.type={source.type!r} is not one of {list(REWARD_TYPES)}")
        if not math.isfinite(source.weight):
            raise ConfigError(f"{key}.weight={source.weight} must be a finite number, e.g. 1.0")
        default = RewardSourceConfig()
        changed = [f.name for f in fields(source) if getattr(source, f.name) != getattr(default, f.name)]
        foreign = [name for name in changed if name not in FIELDS[source.type]]
        if foreign:
            takers = sorted(t for t, names in FIELDS.items() if foreign[0] in names)
            raise ConfigError(
                f"{key}.{foreign[0]} does not apply to {key}.type={source.type!r} (sources of type "
                f"{' or '.join(takers)} take it); the settings of type {source.type} are "
                f"{sorted(FIELDS[source.type])}"
            )
        if source.type == "env":
            continue
        if source.type == "judge":
            _check_judge(key, source)
        elif source.type == "model":
            _check_model(key, source)
        else:
            _check_function(key, source)
        if source.timeout_s <= 0:
            raise ConfigError(f"{key}.timeout_s={source.timeout_s} must be > 0 (seconds per call), e.g. 60")
        if source.max_retries < 0:
            raise ConfigError(f"{key}.max_retries={source.max_retries} must be >= 0, e.g. 2")
        if source.clip is not None and source.clip <= 0:
            raise ConfigError(f"{key}.clip={source.clip} must be > 0 (or null for none), e.g. 5.0")


def _check_function(key: str, source: RewardSourceConfig) -> None:
    if (source.function is None) == (source.url is None):
        raise ConfigError(
            f"{key} (type function) needs one of function (pkg.module:fn) or url (http://...), "
            f"got function={source.function!r}, url={source.url!r}"
        )
    if source.function is not None and not callable(load_entry_point(source.function, f"{key}.function")):
        raise ConfigError(f"{key}.function={source.function!r} is not callable")
    _check_url(key, source.url)


def _check_model(key: str, source: RewardSourceConfig) -> None:
    if source.model is None:
        raise ConfigError(f"{key} (type model) needs model, the reward model's path or hub name")
    for name in ("num_nodes", "num_gpus_per_node"):
        if getattr(source, name) < 1:
            raise ConfigError(f"{key}.{name}={getattr(source, name)} must be >= 1, e.g. 1")


def _check_url(key: str, url: str | None) -> None:
    if url is not None and not url.startswith(("http://", "https://")):
        raise ConfigError(f"{key}.url={url!r} must start with http:// or https://")


def _check_judge(key: str, source: RewardSourceConfig) -> None:
    if source.model is None or (source.url and source.engine is not None):
        raise ConfigError(
            f"{key} (type judge) asks `model` at an OpenAI-compatible `url` (e.g. {key}.url="
            f"http://127.0.0.1:8000/v1 {key}.model=Qwen/Qwen3-8B) or, with no url, engines of its own on "
            f"`model` set up by `engine` (e.g. {key}.model=Qwen/Qwen3-8B {key}.engine={{backend: vllm}}); "
            f"got url={source.url!r}, model={source.model!r}, engine={source.engine!r}"
        )
    if source.function is not None and not callable(load_entry_point(source.function, f"{key}.function")):
        raise ConfigError(f"{key}.function={source.function!r} is not callable")
    _check_url(key, source.url)
    if source.url is None:
        validate_engine_config(judge_engine_config(key, source), f"{key}.engine")
    try:
        names = {
            field for _, field, _, _ in string.Formatter().parse(source.template or JUDGE_TEMPLATE) if field
        }
        re.compile(source.score_pattern)
    except (ValueError, re.error) as exc:
        what = "template" if isinstance(exc, ValueError) else "score_pattern"
        raise ConfigError(f"{key}.{what}: {exc}") from None
    if "response" not in names:
        raise ConfigError(f"{key}.template has no {{response}}: the judge would not see what it rates")
    for name, value, rule in [
        ("temperature", source.temperature, source.temperature >= 0),
        ("max_tokens", source.max_tokens, source.max_tokens >= 1),
        ("concurrency", source.concurrency, source.concurrency >= 1),
    ]:
        if not rule:
            raise ConfigError(
                f"{key}.{name}={value} is out of range, e.g. {getattr(RewardSourceConfig(), name)}"
            )
    if source.api_key_env is not None and source.api_key_env not in os.environ:
        raise ConfigError(f"{key}.api_key_env={source.api_key_env!r}: no such environment variable is set")


def judge_engine_config(key: str, source: RewardSourceConfig) -> InferenceEngineConfig:
    """The engine settings of a judge served by engines of its own; `ConfigError` for an unknown one."""
    try:
        return InferenceEngineConfig(**(source.engine or {}))
    except TypeError as exc:
        known = sorted(f.name for f in fields(InferenceEngineConfig))
        raise ConfigError(f"{key}.engine: {exc}; the settings are {known}") from None


class RunningMoments:
    """Mean and (population) std of every value seen (Chan et al.'s parallel update)."""

    def __init__(self, count: int = 0, mean: float = 0.0, m2: float = 0.0):
        self.count, self.mean, self.m2 = count, mean, m2

    def update(self, values: list[float]) -> None:
        if not values:
            return
        n, mean = len(values), statistics.fmean(values)
        m2 = sum((v - mean) ** 2 for v in values)
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0


class ScoreError(Exception):
    """A scorer failed on its whole batch (raised, timed out, or answered in the wrong shape)."""


class Scorer:
    """A `function` source: `score(inputs)` is, per input, its score or why there is none (a string)."""

    def __init__(self, name: str, cfg: RewardSourceConfig):
        self.name, self.cfg = name, cfg
        self.fn = load_entry_point(cfg.function, f"reward.sources.{name}.function") if cfg.function else None

    async def score(self, inputs: list[RewardInput]) -> list[float | str]:
        try:
            if self.fn is None:  # the deadline covers the retries
                payload = {"inputs": [asdict(i) for i in inputs]}
                answer = await asyncio.wait_for(
                    asyncio.to_thread(post_json, self.cfg, payload), self.cfg.timeout_s
                )
                result = answer.get("rewards") if isinstance(answer, dict) else answer
            elif inspect.iscoroutinefunction(self.fn):
                result = await asyncio.wait_for(self.fn(inputs), self.cfg.timeout_s)
            else:  # a thread that runs past the timeout is left behind, as an env call's
                result = await asyncio.wait_for(asyncio.to_thread(self.fn, inputs), self.cfg.timeout_s)
        except TimeoutError:
            raise ScoreError(f"no scores within timeout_s={self.cfg.timeout_s}") from None
        except ScoreError:
            raise
        except Exception as exc:
            raise ScoreError(f"{type(exc).__name__}: {exc}") from exc
        if hasattr(result, "tolist"):  # a numpy array or a tensor
            result = result.tolist()
        if not isinstance(result, (list, tuple)) or len(result) != len(inputs):
            raise ScoreError(
                f"returned {str(result)[:200]!r} for {len(inputs)} inputs; return one score per input"
            )
        return [_finite(value) for value in result]


class Judge(Scorer):
    """A `judge` source: each input's prompt (`template`) asked of `model` at `url` (or of engines of its
    own), `concurrency` at a time; the score is the first match of `score_pattern` in the answer, or what
    `function` (the parser, `fn(answer) -> float | None`) makes of it."""

    def __init__(self, name: str, cfg: RewardSourceConfig):
        super().__init__(name, cfg)
        self.template, self.pattern = cfg.template or JUDGE_TEMPLATE, re.compile(cfg.score_pattern)
        self.headers = {"Authorization": f"Bearer {os.environ[cfg.api_key_env]}"} if cfg.api_key_env else {}
        self.client: InferenceEngineClient | None = None
        if cfg.url is None:  # engines of its own
            from transformers import AutoTokenizer

            path = resolve_model_path(cfg.model)
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            engine = judge_engine_config(f"reward.sources.{name}", cfg)
            self.client = InferenceEngineClient.from_config(engine, path)
            self.sampling = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens)

    def close(self) -> None:
        if self.client is not None:
            self.client.shutdown()

    async def _ask(self, prompt: str) -> str:
        """The judge's answer to `prompt` (a user message)."""
        messages = [{"role": "user", "content": prompt}]
        if self.client is None:
            body = {
                "model": self.cfg.model,
                "messages": messages,
                "temperature": self.cfg.temperature,
                "max_tokens": self.cfg.max_tokens,
            }
            answer = await asyncio.to_thread(post_json, self.cfg, body, "/chat/completions", self.headers)
            try:
                return answer["choices"][0]["message"]["content"] or ""
            except (KeyError, IndexError, TypeError) as exc:
                raise ScoreError(f"{self.cfg.url} answered no chat completion ({exc!r})") from None
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        out = await self.client.generate(ids, self.sampling)
        return self.tokenizer.decode(out.response_ids, skip_special_tokens=True)

    async def score(self, inputs: list[RewardInput]) -> list[float | str]:
        limit = asyncio.Semaphore(self.cfg.concurrency)

        async def verdict(item: RewardInput) -> float | str:
            asked = (_text(m.get("content")) for m in item.prompt if m.get("role") == "user")
            fields = {
                **item.extras,
                "prompt": "\n\n".join(asked),
                "response": item.response,
                "context": item.context,
            }
            try:
                prompt = self.template.format_map(fields)
            except KeyError as exc:
                return f"template field {exc} is neither prompt, response, context nor a column of the row"
            except Exception as exc:  # a format spec the value does not take, ...
                return f"the template cannot be filled: {type(exc).__name__}: {exc}"
            async with limit:
                try:
                    text = await asyncio.wait_for(self._ask(prompt), self.cfg.timeout_s)
                except TimeoutError:
                    return f"no verdict within timeout_s={self.cfg.timeout_s}"
                except Exception as exc:  # a dead engine, an endpoint's error: this verdict only
                    return str(exc) if isinstance(exc, ScoreError) else f"{type(exc).__name__}: {exc}"
            if self.fn is not None:
                try:
                    value = self.fn(text)
                except Exception as exc:
                    return f"{self.cfg.function} raised on the verdict {text[:100]!r}: {type(exc).__name__}: {exc}"
                return f"the verdict {text[:100]!r} has no score" if value is None else _finite(value)
            match = self.pattern.search(text)
            found = match and (match.group(1) if self.pattern.groups else match.group())
            try:
                return _finite(float(found)) if found else f"the verdict {text[:100]!r} has no score"
            except ValueError:
                return f"the verdict's score {found!r} (of {text[:100]!r}) is not a number"

        return list(await asyncio.gather(*(verdict(item) for item in inputs)))


class RewardModel(Scorer):
    """A `model` source: its worker group (`WorkerGroups.reward_models[name]`, a restart replaces it) scores
    each input's text. With the policy's tokenizer and chat template, the text is the tokens as generated
    (context and response); otherwise the prompt and the decoded response rendered again with the reward
    model's own template (as a reward model is trained: one user turn and the answer)."""

    def __init__(
        self, name: str, cfg: RewardSourceConfig, groups: WorkerGroups, tokenizer: Any, trainer: TrainerConfig
    ):
        super().__init__(name, cfg)
        from transformers import AutoTokenizer

        self.groups, self.trainer = groups, trainer
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model))
        self.same_tokens = (
            self.tokenizer.get_vocab() == tokenizer.get_vocab()
            and self.tokenizer.chat_template == tokenizer.chat_template
        )

    def token_ids(self, item: RewardInput) -> list[int]:
        """What the reward model reads for `item`."""
        if self.same_tokens:
            return item.context_ids + item.response_ids
        messages = [*item.prompt, {"role": "assistant", "content": item.response}]
        return self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)

    async def score(self, inputs: list[RewardInput]) -> list[float | str]:
        """A dead worker is not a failed score: `WorkerDiedError` reaches the trainer, which restarts the
        workers from the last checkpoint; any other error fails the batch's episodes (`ScoreError`)."""
        try:
            return await asyncio.to_thread(self._forward, inputs)
        except WorkerDiedError:
            raise
        except Exception as exc:
            raise ScoreError(f"{type(exc).__name__}: {exc}") from exc

    def _forward(self, inputs: list[RewardInput]) -> list[float | str]:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        rows = collate_sequences(
            [
                TrainingSequence(
                    i.uid, i.trajectory_id, i.turn, True, self.token_ids(i), [pad], [1], [0.0], [0.0]
                )
                for i in inputs
            ],
            pad,
        )
        group = self.groups.reward_models[self.name]
        staged = group.stage(rows, [(0, len(rows))], self.trainer.balance_dp, self.trainer.delay_split_by_dp)
        return [_finite(v) for v in group.forward(staged)["scores"][:, 0].tolist()]


def post_json(
    cfg: RewardSourceConfig, payload: dict[str, Any], path: str = "", headers: dict[str, str] | None = None
) -> Any:
    """`payload` POSTed to `cfg.url` + `path`, the JSON answer; retried `cfg.max_retries` times on
    connection errors and 5xx answers (`ScoreError` once they are used, or at once for another error)."""
    url = cfg.url + path
    request = urllib.request.Request(
        url,
        json.dumps(payload, default=str).encode(),
        {"Content-Type": "application/json", **(headers or {})},
    )
    for attempt in range(cfg.max_retries + 1):
        try:
            with urllib.request.urlopen(request, timeout=cfg.timeout_s) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            if exc.code < 500 or attempt == cfg.max_retries:
                raise ScoreError(f"{url} answered {exc.code}: {exc.read()[:200]!r}") from None
        except (OSError, http.client.HTTPException) as exc:  # URLError, timeouts, resets, SSL, cut answers
            if attempt == cfg.max_retries:
                raise ScoreError(f"{url}: {exc} ({attempt + 1} tries)") from None
        except ValueError as exc:
            raise ScoreError(f"{url} answered no JSON: {exc}") from None
        time.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


def _finite(value: Any) -> float | str:
    """`value` (a number, numpy's included) as a score, or why it is none."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return f"a score that is not a finite number: {value!r}"
    return float(value)


def _text(content: Any) -> str:
    """A message's content as text (text parts joined)."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content or "")


class Rewards:
    """The run's reward sources (`reward`), applied to finished episodes by `score`."""

    def __init__(
        self,
        cfg: RewardConfig,
        tokenizer: Any,
        env_failure: str,
        groups: WorkerGroups | None = None,
        trainer: TrainerConfig | None = None,
    ):
        """`groups` hold the reward models' worker groups (`Cluster`), `trainer` their micro-batch settings."""
        sources = source_configs(cfg)
        self.tokenizer, self.env_failure = tokenizer, env_failure
        self.env = next((name for name, s in sources.items() if s.type == "env"), None)
        self.env_weight = sources[self.env].weight if self.env else 0.0

        def scorer(name: str, source: RewardSourceConfig) -> Scorer:
            if source.type == "model":
                assert groups is not None, "a reward model scores in its worker group"
                return RewardModel(name, source, groups, tokenizer, trainer or TrainerConfig())
            return (Judge if source.type == "judge" else Scorer)(name, source)

        self.scorers = [scorer(name, s) for name, s in sources.items() if s.type != "env"]
        self.moments = {s.name: RunningMoments() for s in self.scorers if s.cfg.normalize}

    @property
    def env_only(self) -> bool:
        """The default: episodes train on the environment's rewards as they are."""
        return not self.scorers and self.env_weight == 1.0

    def close(self) -> None:
        """Stop the engines of judges served by engines of their own."""
        for scorer in self.scorers:
            if isinstance(scorer, Judge):
                scorer.close()

    def state_dict(self) -> dict[str, Any]:
        """The running statistics of the normalised sources (nothing without one)."""
        if not self.moments:
            return {}
        return {"reward_moments": {name: vars(m).copy() for name, m in self.moments.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("reward_moments", {})
        self.moments = {name: RunningMoments(**saved.get(name, {})) for name in self.moments}

    async def score(self, episodes: list[Episode], train: bool = True) -> None:
        """Each episode's turns rewarded by every source (see the module docstring) and `episode.scores`
        set to each source's score; `train`: update the running statistics (not for evaluation)."""
        if self.env_only:
            return
        live = [e for e in episodes if e.stop_reason != "error" and e.trajectory.turns]
        for episode in episodes if self.env else ():
            episode.scores[self.env] = episode.reward
        kinds = {s.cfg.per_turn for s in self.scorers}  # decoding is CPU work: off the run's event loop
        inputs = await asyncio.to_thread(
            lambda: {(id(e), per_turn): self._inputs(e, per_turn) for e in live for per_turn in kinds}
        )
        results = await asyncio.gather(*(self._score(scorer, live, inputs, train) for scorer in self.scorers))
        for episode in live:
            turns = episode.trajectory.turns
            for turn in turns:
                turn.reward *= self.env_weight
            for scorer, (scored, failed) in zip(self.scorers, results, strict=True):
                if id(episode) in failed:
                    self._fail(episode, scorer.name, failed[id(episode)])
                    break
                for turn, value in scored[id(episode)]:
                    turns[turn].reward += scorer.cfg.weight * value
            episode.reward = sum(t.reward for t in turns)

    async def _score(
        self,
        scorer: Scorer,
        live: list[Episode],
        inputs: dict[tuple[int, bool], list[RewardInput]],
        train: bool,
    ) -> tuple[dict[int, list[tuple[int, float]]], dict[int, str]]:
        """One scorer's (episode id -> [(turn, score normalised and clipped)], episode id -> why it failed);
        each episode's `scores` gets the scorer's mean raw score (NaN when it failed)."""
        per_episode = {id(e): inputs[id(e), scorer.cfg.per_turn] for e in live}
        flat = [i for items in per_episode.values() for i in items]
        failed: dict[int, str] = {}
        try:
            values = await scorer.score(flat) if flat else []
        except ScoreError as exc:
            for episode in live:
                episode.scores[scorer.name] = math.nan
            return {}, {id(e): str(exc) for e in live}
        raw: dict[int, list[tuple[int, float]]] = {}
        it = iter(values)
        for episode in live:
            items = per_episode[id(episode)]
            got = [next(it) for _ in items]
            given = [v for v in got if not isinstance(v, str)]
            if len(given) < len(items):
                failed[id(episode)] = next(v for v in got if isinstance(v, str))
                episode.scores[scorer.name] = math.nan
                continue
            raw[id(episode)] = [(item.turn, v) for item, v in zip(items, given, strict=True)]
            episode.scores[scorer.name] = statistics.fmean(given)
        moments = self.moments.get(scorer.name)
        if moments is not None and train:
            moments.update([v for got in raw.values() for _, v in got])
        return {
            key: [(turn, self._shaped(scorer, moments, v)) for turn, v in got] for key, got in raw.items()
        }, failed

    @staticmethod
    def _shaped(scorer: Scorer, moments: RunningMoments | None, value: float) -> float:
        if moments is not None and moments.count:  # scores that never varied are only centred
            value = (value - moments.mean) / (moments.std if moments.std > 1e-6 else 1.0)
        clip = scorer.cfg.clip
        return value if clip is None else min(max(value, -clip), clip)

    def _inputs(self, episode: Episode, per_turn: bool) -> list[RewardInput]:
        trajectory, row = episode.trajectory, episode.row
        turns = list(enumerate(trajectory.turns))
        decode = self.tokenizer.decode
        return [
            RewardInput(
                uid=trajectory.uid,
                trajectory_id=trajectory.trajectory_id,
                turn=i,
                prompt=list(row.prompt) if row else [],
                extras=dict(row.extras) if row else {},
                context=decode(turn.context_ids, skip_special_tokens=False),
                response=decode(turn.response_ids, skip_special_tokens=True),
                env_reward=turn.reward if per_turn else episode.reward,
                context_ids=list(turn.context_ids),
                response_ids=list(turn.response_ids),
            )
            for i, turn in (turns if per_turn else turns[-1:])
        ]

    def _fail(self, episode: Episode, name: str, why: str) -> None:
        episode.stop_reason, episode.error = "error", f"reward source {name!r}: {why}"
        fail_turns(episode.trajectory.turns, self.env_failure)
        episode.reward = 0.0


def reward_metrics(episodes: list[Episode]) -> dict[str, float]:
    """`reward/<name>_mean`, `_std` (of the scores each source gave) and `_failures` over `episodes`."""
    metrics = {}
    for name in sorted({name for e in episodes for name in e.scores}):
        values = [e.scores[name] for e in episodes if name in e.scores]
        given = [v for v in values if not math.isnan(v)]
        metrics[f"reward/{name}_mean"] = statistics.fmean(given) if given else math.nan
        metrics[f"reward/{name}_std"] = statistics.pstdev(given) if given else math.nan
        metrics[f"reward/{name}_failures"] = float(len(values) - len(given))
    return metrics
