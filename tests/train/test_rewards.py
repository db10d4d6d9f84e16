"""Reward sources (`reward.sources`): the weighted sum each turn trains on, per-turn scoring, failures that
fail only their episodes, running normalisation and its state, a scorer behind a real HTTP server, and
the config errors. Episodes are plain data over the tiny model's real tokenizer."""

import asyncio
import http.server
import json
import math
import threading
from typing import ClassVar

import numpy as np
import pytest
from transformers import AutoTokenizer

from skyrl.train.config import compose_config
from skyrl.train.dataset.preprocess import Trajectory, Turn
from skyrl.train.dataset.prompt_dataset import PromptRow
from skyrl.train.generator.rollout import Episode
from skyrl.train.rewards import JUDGE_TEMPLATE, Rewards, reward_metrics
from skyrl.train.schema import OpenAIServerConfig, RewardConfig
from skyrl.train.utils.errors import ConfigError
from skyrl.train.utils.tiny_model import create_tiny_model

from .inference.conftest import memorise, serving

HERE = __name__


def chars(inputs):
    """A scorer: the length of the response text."""
    return [float(len(i.response)) for i in inputs]


def turn_index(inputs):
    return [float(i.turn) for i in inputs]


def verdict_words(answer):
    """A judge's parser: the verdicts it knows, scaled; None for the others."""
    return {"7": 70.0, "2": 20.0}.get(answer.strip())


def numpy_lengths(inputs):
    return np.array([len(i.response) for i in inputs], dtype=np.float32)


async def slow(inputs):
    await asyncio.sleep(5)
    return [1.0] * len(inputs)


def broken(inputs):
    raise RuntimeError("the judge is down")


def none_for_short(inputs):
    return [None if len(i.response) < 3 else 1.0 for i in inputs]


def too_few(inputs):
    return [1.0]


def echo_extras(inputs):
    return [float(i.extras["target"]) + i.env_reward for i in inputs]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def episode(
    tokenizer,
    uid: str,
    responses: list[str],
    turn_rewards: list[float],
    target: int = 3,
    asked: str = "Guess a number.",
) -> Episode:
    turns, context = [], tokenizer.encode(asked)
    for text, reward in zip(responses, turn_rewards, strict=True):
        ids = tokenizer.encode(text)
        turns.append(Turn(list(context), ids, [0.0] * len(ids), [1] * len(ids), reward))
        context += ids + tokenizer.encode(" Higher.")
    row = PromptRow(0, [{"role": "user", "content": asked}], extras={"target": target})
    return Episode(Trajectory(uid, f"{uid}/0", turns), "done", sum(turn_rewards), row=row)


def rewards(tokenizer, sources: dict, env_failure: str = "mask") -> Rewards:
    return Rewards(RewardConfig(sources), tokenizer, env_failure)


def score(rewarder: Rewards, episodes: list[Episode], train: bool = True) -> None:
    asyncio.run(rewarder.score(episodes, train))


def test_a_turn_trains_on_the_weighted_sum_of_its_sources_and_each_is_logged(tokenizer):
    rewarder = rewards(
        tokenizer,
        {
            "env": {"type": "env", "weight": 0.5},
            "chars": {"type": "function", "function": f"{HERE}:chars", "weight": 2.0},
            "turns": {"type": "function", "function": f"{HERE}:turn_index", "weight": 10.0, "per_turn": True},
        },
    )
    episodes = [
        episode(tokenizer, "a", ["five", "seven"], [1.0, 3.0]),
        episode(tokenizer, "b", ["one"], [0.0]),
    ]
    score(rewarder, episodes)
    # env * 0.5 on each turn; chars on the last turn only; turns (per turn) on each turn
    assert [t.reward for t in episodes[0].trajectory.turns] == [0.5 + 0.0, 1.5 + 2 * len("seven") + 10.0]
    assert [t.reward for t in episodes[1].trajectory.turns] == [0.0 + 2 * len("one") + 0.0]
    assert [e.reward for e in episodes] == [sum(t.reward for t in e.trajectory.turns) for e in episodes]
    metrics = reward_metrics(episodes)
    assert metrics["reward/env_mean"] == 2.0 and metrics["reward/chars_mean"] == (5 + 3) / 2
    assert metrics["reward/chars_std"] == 1.0 and metrics["reward/turns_mean"] == (0.5 + 0) / 2
    assert metrics["reward/chars_failures"] == 0.0


def test_numpy_scores_are_scores(tokenizer):
    rewarder = rewards(
        tokenizer,
        {
            "env": {"type": "env", "weight": 0.0},
            "n": {"type": "function", "function": f"{HERE}:numpy_lengths"},
        },
    )
    episodes = [episode(tokenizer, "a", ["seven"], [0.0]), episode(tokenizer, "b", ["one"], [0.0])]
    score(rewarder, episodes)
    assert [e.reward for e in episodes] == [5.0, 3.0] and "n" in episodes[0].scores


def test_a_scorer_gets_the_row_the_context_and_the_env_reward(tokenizer):
    rewarder = rewards(
        tokenizer,
        {"env": {"type": "env", "weight": 0.0}, "x": {"type": "function", "function": f"{HERE}:echo_extras"}},
    )
    (scored,) = episodes = [episode(tokenizer, "a", ["two", "four"], [0.25, 0.5], target=7)]
    inputs = rewarder._inputs(scored, per_turn=False)
    assert [(i.turn, i.response, i.extras, i.env_reward) for i in inputs] == [
        (1, "four", {"target": 7}, 0.75)
    ]
    assert inputs[0].context.startswith("Guess a number.") and inputs[0].context.endswith("two Higher.")
    score(rewarder, episodes)
    assert scored.reward == 7.75


@pytest.mark.parametrize(
    ("function", "failed", "why"),
    [
        ("broken", [True, True], "RuntimeError: the judge is down"),
        ("too_few", [True, True], "returned '[1.0]' for 2 inputs; return one score per input"),
        ("none_for_short", [False, True], "a score that is not a finite number: None"),
        ("slow", [True, True], "no scores within timeout_s=0.2"),
    ],
    ids=["raises", "wrong-length", "not-a-number", "timeout"],
)
@pytest.mark.parametrize("env_failure", ["mask", "zero_reward"])
def test_a_scorer_that_fails_fails_only_its_episodes_as_an_env_failure_does(
    tokenizer, function, failed, why, env_failure
):
    source = {"type": "function", "function": f"{HERE}:{function}", "timeout_s": 0.2}
    rewarder = rewards(tokenizer, {"env": {"type": "env"}, "judge": source}, env_failure)
    episodes = [episode(tokenizer, "a", ["seven"], [1.0]), episode(tokenizer, "b", ["1"], [1.0])]
    episodes.append(episode(tokenizer, "c", ["seven"], [1.0]))
    episodes[2].stop_reason, episodes[2].error = "error", "the env raised"  # failed before: not scored
    episodes[2].reward = 0.0
    score(rewarder, episodes)
    for e, fails in zip(episodes, failed, strict=False):
        assert (e.stop_reason == "error") == fails
        if fails:
            assert e.error == f"reward source 'judge': {why}" and e.reward == 0.0
            assert e.trajectory.turns[0].loss_mask == [int(env_failure != "mask")] * len(
                e.trajectory.turns[0].loss_mask
            )
        else:
            assert e.reward == 2.0
    assert episodes[2].error == "the env raised" and "judge" not in episodes[2].scores
    assert reward_metrics(episodes)["reward/judge_failures"] == float(sum(failed))


def test_normalised_scores_use_the_running_statistics_of_training_batches_only(tokenizer):
    source = {"type": "function", "function": f"{HERE}:chars", "normalize": True, "clip": 1.5}
    rewarder = rewards(tokenizer, {"env": {"type": "env", "weight": 0.0}, "chars": source})
    batches = [["a", "abcd", "abcdefgh"], ["ab", "abcdefghijklmnop"]]
    seen = []
    for texts in batches:
        episodes = [episode(tokenizer, t, [t], [0.0]) for t in texts]
        score(rewarder, episodes)
        seen += [len(t) for t in texts]
        mean, std = np.mean(seen), np.std(seen)
        expected = [float(np.clip((len(t) - mean) / std, -1.5, 1.5)) for t in texts]
        assert [e.reward for e in episodes] == pytest.approx(expected, abs=1e-9)
    assert max(abs(e.reward) for e in episodes) == 1.5  # clipped
    state = json.loads(json.dumps(rewarder.state_dict()))  # as a checkpoint keeps it
    evaluated = [episode(tokenizer, "e", ["abcdefghijklmnopqrstuvwxyz"], [0.0])]
    score(rewarder, evaluated, train=False)
    assert rewarder.state_dict() == state, "evaluation does not move the statistics"
    resumed = rewards(tokenizer, {"env": {"type": "env", "weight": 0.0}, "chars": source})
    resumed.load_state_dict(state)
    again = [episode(tokenizer, "x", ["abc"], [0.0])]
    score(resumed, again)
    score(rewarder, same := [episode(tokenizer, "x", ["abc"], [0.0])])
    assert again[0].reward == same[0].reward and resumed.state_dict() == rewarder.state_dict()
    assert rewards(tokenizer, {"env": {"type": "env"}}).state_dict() == {}, (
        "no key without a normalised source"
    )


class Scores(http.server.BaseHTTPRequestHandler):
    """A reward server: the length of each response; the first request of a run answers 503."""

    calls: ClassVar[list[int]] = []

    def do_POST(self):
        inputs = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["inputs"]
        Scores.calls.append(len(inputs))
        status, body = (
            (503, {}) if len(Scores.calls) == 1 else (200, {"rewards": [len(i["response"]) for i in inputs]})
        )
        if inputs[0]["extras"].get("bad"):
            status = 400
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def reward_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Scores)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()


def test_a_url_source_posts_the_batch_and_retries_a_server_error(tokenizer, reward_server):
    Scores.calls.clear()
    source = {"type": "function", "url": reward_server, "max_retries": 1}
    rewarder = rewards(tokenizer, {"env": {"type": "env", "weight": 0.0}, "length": source})
    episodes = [episode(tokenizer, "a", ["seven"], [0.0]), episode(tokenizer, "b", ["one"], [0.0])]
    score(rewarder, episodes)
    assert Scores.calls == [2, 2] and [e.reward for e in episodes] == [5.0, 3.0]
    bad = [episode(tokenizer, "c", ["seven"], [0.0])]
    bad[0].row.extras["bad"] = True
    score(rewarder, bad)
    assert Scores.calls == [2, 2, 1], "a 4xx is not retried"
    assert bad[0].error.startswith(f"reward source 'length': {reward_server} answered 400")


ASKED = "Is the sky blue?"
VERDICTS = {"Yes.": "7", "No.": "2", "Maybe.": "unsure"}  # what the tiny judge has memorised


@pytest.fixture(scope="module")
def judge_path(tmp_path_factory):
    """A tiny judge that rates the answers to ASKED as VERDICTS says."""
    path = create_tiny_model(tmp_path_factory.mktemp("judge"))
    judge = AutoTokenizer.from_pretrained(path)

    def asked(response):
        prompt = JUDGE_TEMPLATE.format(prompt=ASKED, response=response)
        messages = [{"role": "user", "content": prompt}]
        return judge.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    eos = [judge.eos_token_id]
    memorise(path, [(asked(r), judge.encode(v, add_special_tokens=False) + eos) for r, v in VERDICTS.items()])
    return path


@pytest.fixture(scope="module")
def judge_url(ray_cluster, judge_path):
    """The tiny judge behind the run's own endpoint."""
    with serving(judge_path, OpenAIServerConfig(port=0, served_model_name="judge")) as (_, server):
        yield f"{server.url}/v1"


def test_a_judge_rates_each_response_and_an_answer_without_a_score_fails_only_its_episode(
    tokenizer, judge_url
):
    source = {"type": "judge", "url": judge_url, "model": "judge", "weight": 0.1}
    rewarder = rewards(tokenizer, {"env": {"type": "env"}, "judge": source})
    episodes = [episode(tokenizer, r, [r], [1.0], asked=ASKED) for r in VERDICTS]
    score(rewarder, episodes)
    assert [e.reward for e in episodes] == [pytest.approx(1.7), pytest.approx(1.2), 0.0]
    assert episodes[2].error == "reward source 'judge': the verdict 'unsure' has no score"
    metrics = reward_metrics(episodes)
    assert (metrics["reward/judge_mean"], metrics["reward/judge_failures"]) == (4.5, 1.0)
    worded = rewards(tokenizer, {"env": {"type": "env"}, "judge": {**source, "score_pattern": r"^(\w+)$"}})
    episodes = [episode(tokenizer, r, [r], [1.0], asked=ASKED) for r in VERDICTS]
    score(worded, episodes)
    assert episodes[0].reward == pytest.approx(1.7)  # the pattern's group is the score
    assert (
        episodes[2].error
        == "reward source 'judge': the verdict's score 'unsure' (of 'unsure') is not a number"
    )
    parsed = rewards(
        tokenizer, {"env": {"type": "env"}, "judge": {**source, "function": f"{HERE}:verdict_words"}}
    )
    episodes = [episode(tokenizer, r, [r], [1.0], asked=ASKED) for r in VERDICTS]
    score(parsed, episodes)
    assert [e.reward for e in episodes] == [pytest.approx(8.0), pytest.approx(3.0), 0.0]
    assert episodes[2].error == "reward source 'judge': the verdict 'unsure' has no score"
    late = rewards(tokenizer, {"env": {"type": "env"}, "judge": {**source, "timeout_s": 1e-4}})
    episodes = [episode(tokenizer, r, [r], [1.0], asked=ASKED) for r in VERDICTS]
    score(late, episodes)
    assert {e.error for e in episodes} == {"reward source 'judge': no verdict within timeout_s=0.0001"}


def test_a_judge_on_engines_of_its_own_gives_the_same_verdicts(ray_cluster, tokenizer, judge_path):
    engine = {"backend": "hf", "device": "cpu"}
    source = {"type": "judge", "model": str(judge_path), "engine": engine, "weight": 0.1}
    rewarder = rewards(tokenizer, {"env": {"type": "env"}, "judge": source})
    try:
        episodes = [episode(tokenizer, r, [r], [1.0], asked=ASKED) for r in VERDICTS]
        score(rewarder, episodes)
    finally:
        rewarder.close()
    assert [e.reward for e in episodes] == [pytest.approx(1.7), pytest.approx(1.2), 0.0]
    assert episodes[2].error == "reward source 'judge': the verdict 'unsure' has no score"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["+reward.sources.judge={type: function}"],
            r"reward.sources.judge \(type function\) needs one of function",
        ),
        (
            ["+reward.sources.judge={type: critic}"],
            r"reward.sources.judge.type='critic' is not one of \['env', 'function', 'judge', 'model'\]",
        ),
        (
            ["+reward.sources.judge={tpye: function}"],
            r"reward.sources.judge has no field 'tpye'; its fields are",
        ),
        (
            ["+reward.sources.env.normalize=true"],
            r"reward.sources.env.normalize does not apply to reward.sources.env.type='env' \(sources of type function or judge or model take it\)",
        ),
        (
            [f"+reward.sources.judge={{type: function, function: '{HERE}:chars', clip: -1}}"],
            r"clip=-1.0 must be > 0",
        ),
        (["+reward.sources.judge={type: function, url: 'ftp://x'}"], r"url='ftp://x' must start with http"),
        (
            ["+reward.sources.judge={type: function, function: 'nope:fn'}"],
            r"function='nope:fn': cannot import",
        ),
        (["+reward.sources.my-judge={type: function, function: 'os:getcwd'}"], r"letters, digits and _ only"),
        (["+reward.sources.env2={type: env}"], r"\['env', 'env2'\] are all of type env"),
        (["+reward.sources.judge={type: judge, url: 'http://x/v1'}"], r"\(type judge\) asks `model` at an"),
        (
            ["+reward.sources.judge={type: judge, model: m, engine: {backend: nope}}"],
            r"judge.engine.backend='nope'",
        ),
        (
            ["+reward.sources.judge={type: judge, model: m, engine: {gpus: 1}}"],
            r"judge.engine: .*'gpus'.*settings are",
        ),
        (
            ["+reward.sources.judge={type: judge, url: 'http://x/v1', model: m, template: 'Rate {prompt}'}"],
            r"judge.template has no \{response\}",
        ),
        (
            [
                f"+reward.sources.judge={{type: function, function: '{HERE}:chars', template: 'x {{response}}'}}"
            ],
            r"judge.template does not apply to reward.sources.judge.type='function' \(sources of type judge take it\)",
        ),
        (["+reward.sources.rm={type: model}"], r"reward.sources.rm \(type model\) needs model"),
        (
            ["+reward.sources.env.model=m"],
            r"reward.sources.env.model does not apply to reward.sources.env.type='env'",
        ),
        (
            ["+reward.sources.rm={type: model, model: m, sequence_parallel_size: 2}"],
            r"reward.sources.rm.sequence_parallel_size=2 does not divide the 1 reward model rm ranks "
            r"\(trainer.placement.policy_num_nodes x policy_num_gpus_per_node\); use one of \[1\]",
        ),
    ],
    ids=[
        "no-scorer",
        "unknown-type",
        "misspelt-field",
        "env-normalised",
        "negative-clip",
        "bad-url",
        "missing-module",
        "bad-name",
        "two-envs",
        "judge-without-model",
        "judge-engine-backend",
        "judge-engine-unknown",
        "template-without-response",
        "judge-setting-on-function",
        "model-without-path",
        "judge-setting-on-env",
        "model-sp-over-its-ranks",
    ],
)
def test_a_source_that_cannot_score_is_a_config_error_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_config(overrides)


def test_the_default_is_the_env_rewards_untouched(tokenizer):
    rewarder = rewards(tokenizer, compose_config([]).reward.sources)
    episodes = [episode(tokenizer, "a", ["seven"], [0.5])]
    score(rewarder, episodes)
    assert rewarder.env_only and episodes[0].reward == 0.5 and episodes[0].scores == {}
    assert reward_metrics(episodes) == {} and not math.isnan(episodes[0].reward)
