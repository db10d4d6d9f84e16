"""The agent path: user agents against the real HTTP endpoint over a real engine, compared with the
env-based rollout manager on the same conversations."""

import asyncio
from dataclasses import replace

import httpx
import pytest

from skyrl.envs import guess_number
from skyrl.train.dataset.preprocess import prefix_consistent, trajectories_to_sequences
from skyrl.train.dataset.prompt_dataset import parse_rows
from skyrl.train.generator.agent import AgentGenerator, ClientInfo, turn_rewards
from skyrl.train.generator.base import generate_checked
from skyrl.train.generator.rollout import RolloutManager
from skyrl.train.inference.openai_server import OpenAIServer
from skyrl.train.schema import EnvironmentConfig, GeneratorConfig, OpenAIServerConfig, SamplingConfig
from skyrl.train.utils.background_loop import BackgroundLoop
from skyrl.train.utils.errors import ConfigError

from . import user_agents, user_generators
from .test_rollout import PROMPTS

AGENTS = "tests.train.generator.user_agents"
GREEDY = SamplingConfig(temperature=0.0)
DIGITS = [str(i) for i in range(1, 9)]
GUESS_ENV = EnvironmentConfig(
    "guess_number",
    {"guess_number": {"min_value": 1, "max_value": 8, "max_turns": 4, "allowed_tokens": DIGITS}},
)
GUESS = {"n_samples_per_prompt": 2, "max_turns": 4, "max_generate_length": 1, "max_input_length": 256}


@pytest.fixture(scope="module")
def served(hf_client, tiny_model_path):
    """The hf engine behind an endpoint with an API key, on a loop of its own as in a training run."""
    loop = BackgroundLoop()
    server = OpenAIServer(hf_client, tiny_model_path, OpenAIServerConfig(port=0, api_key="secret"))
    loop.run(server.start())
    yield loop, server
    loop.run(server.stop())
    loop.close()


@pytest.fixture
def agent_generator(served, tokenizer):
    """`make(agent, env=..., **generator_settings)`: an `AgentGenerator` on the shared endpoint."""
    _, server = served
    made = []

    def make(agent: str, env: EnvironmentConfig = GUESS_ENV, **settings) -> AgentGenerator:
        cfg = GeneratorConfig(
            **{"n_samples_per_prompt": 2, "max_generate_length": 6, "agent": agent, **settings}
        )
        made.append(AgentGenerator(server, tokenizer, cfg, env))
        return made[-1]

    yield make
    for generator in made:
        generator.close()
        assert not generator.sessions._open, "every session is closed when its episode ends"


def run(served, generator, prompts, sampling=None):
    loop, _ = served
    return loop.run(generator.agenerate(prompts, None, sampling))


def assert_same_turns(ours, theirs):
    assert len(ours.turns) == len(theirs.turns)
    for a, b in zip(ours.turns, theirs.turns, strict=True):
        assert a.context_ids == b.context_ids
        assert a.response_ids == b.response_ids
        assert a.loss_mask == b.loss_mask
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert a.reward == b.reward


def test_the_example_agent_records_what_the_rollout_manager_builds(served, agent_generator, tokenizer):
    """The openai-client example plays guess_number through chat messages; its trajectories are the env
    path's, token for token (greedy, the env's action space applies to the agent's sessions)."""
    loop, server = served
    # one row per hidden number: greedy play guesses the same first number everywhere, so some games are won
    rows = parse_rows([{**guess_number.make_dataset(1)[0], "target": t} for t in range(1, 9)], "guess")
    agent = agent_generator("examples.openai_agent.agent:play", **GUESS)
    manager = RolloutManager(server.client, tokenizer, GeneratorConfig(**GUESS), GUESS_ENV)
    ours = run(served, agent, rows, GREEDY)
    theirs = loop.run(manager.agenerate(rows, None, GREEDY))
    assert [e.reward for e in ours.episodes] == [e.reward for e in theirs.episodes]
    assert 0 < sum(e.reward for e in ours.episodes) < len(rows) * 2  # some games won, some lost
    assert max(len(e.trajectory.turns) for e in ours.episodes) > 1
    for a, b in zip(ours.episodes, theirs.episodes, strict=True):
        assert a.stop_reason == "done" and a.env_metrics["guesses"] == b.env_metrics["guesses"]
        assert_same_turns(a.trajectory, b.trajectory)
    assert ours.metrics["episode/prefix_consistent_fraction"] == 1.0
    assert ours.metrics["agent/tool_parse_failures"] == 0.0  # a plain-chat agent: no tool-call tags


def test_multi_token_answers_continue_the_context_as_the_rollout_manager_does(
    served, agent_generator, tokenizer
):
    """Answers of several tokens, ended by the eos or cut by max_tokens, against the env twin."""
    loop, server = served
    chatty = EnvironmentConfig(
        "tests.envs.user_envs:ChattyEnv", {"tests.envs.user_envs:ChattyEnv": {"turns": 3}}
    )
    settings = {"n_samples_per_prompt": 2, "max_turns": 3, "max_generate_length": 6}
    manager = RolloutManager(server.client, tokenizer, GeneratorConfig(**settings), chatty)
    agent = agent_generator(f"{AGENTS}:chatty", chatty, **settings)
    ours, theirs = (
        run(served, agent, PROMPTS[:1], GREEDY),
        loop.run(manager.agenerate(PROMPTS[:1], None, GREEDY)),
    )
    for a, b in zip(ours.episodes, theirs.episodes, strict=True):
        assert a.reward == b.reward == 1.0
        assert_same_turns(a.trajectory, b.trajectory)
        assert prefix_consistent(a.trajectory)


def test_a_history_rewriting_agent_trains_one_sequence_per_request(served, agent_generator, tokenizer):
    """A sync agent (run in the pool) re-rendering its conversation each request: every request is a
    step-wise row of its own, with the request's own prompt and its per-request reward."""
    (episode, _) = run(served, agent_generator(f"{AGENTS}:rewriting"), PROMPTS[:1]).episodes
    turns = episode.trajectory.turns
    assert len(turns) == 3 and not prefix_consistent(episode.trajectory)
    assert [t.reward for t in turns] == [0.0, 0.5, 1.0] and episode.reward == 1.5
    assert episode.env_metrics == {"tried": 3.0}
    tried = [tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in turns]
    for k, turn in enumerate(turns):
        messages = [
            {"role": "system", "content": "Play."},
            {"role": "user", "content": f"Guess. Tried: {' '.join(tried[:k])}"},
        ]
        assert turn.context_ids == tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert turn.loss_mask == [1] * len(turn.response_ids)
    rows = trajectories_to_sequences([episode.trajectory], step_wise=True)
    assert [r.prompt_ids for r in rows] == [t.context_ids for t in turns]


def test_token_level_requests_are_recorded_as_sent(served, agent_generator, tokenizer):
    (episode, _) = run(served, agent_generator(f"{AGENTS}:token_level"), PROMPTS[:1]).episodes
    first, second = episode.trajectory.turns
    assert first.context_ids == tokenizer.encode("Guess the number.")
    assert second.context_ids == first.context_ids + first.response_ids + first.context_ids[:2]
    assert prefix_consistent(episode.trajectory)
    assert all(len(t.logprobs) == len(t.response_ids) == 3 for t in (first, second))  # asked or not
    assert (first.reward, second.reward) == (0.0, 1.0)


def test_an_agent_that_raises_fails_its_episode_only(served, agent_generator):
    out = run(served, agent_generator(f"{AGENTS}:flaky", max_env_failure_fraction=0.5), PROMPTS)
    good, bad = out.episodes[:2], out.episodes[2:]
    assert all(e.stop_reason == "done" and e.reward == 1.0 for e in good)
    for e in bad:
        assert e.stop_reason == "error" and "RuntimeError: simulated agent crash" in e.error
        (turn,) = e.trajectory.turns  # the request it made before raising, out of the loss
        assert turn.loss_mask == [0] * len(turn.response_ids) and turn.reward == 0.0
    assert out.metrics["episode/env_failures"] == 2.0


def test_an_agent_past_its_timeout_fails_and_its_late_requests_get_a_409(served, agent_generator):
    user_agents.LATE.clear()
    out = run(
        served,
        agent_generator(
            f"{AGENTS}:slow", agent_timeout_s=1.0, n_samples_per_prompt=1, max_env_failure_fraction=1.0
        ),
        PROMPTS[:1],
    )
    (episode,) = out.episodes
    assert episode.stop_reason == "error" and "timed out after generator.agent_timeout_s=1.0" in episode.error
    (info,) = user_agents.LATE
    late = asyncio.run(user_agents.chat(info, [{"role": "user", "content": "still there?"}]))
    assert late.status_code == 409 and late.json()["error"]["code"] == "session_closed"


def test_a_session_without_requests_is_an_empty_episode(served, agent_generator, caplog):
    (episode, _) = run(served, agent_generator(f"{AGENTS}:silent"), PROMPTS[:1]).episodes
    assert episode.stop_reason == "empty" and episode.reward == 0.0
    assert all(not any(t.loss_mask) for t in episode.trajectory.turns)
    # a whole batch of them: the agent probably does not send its session header
    assert "made no request in any of its 2 sessions" in caplog.text and "X-Session-Id" in caplog.text


def test_per_request_rewards_must_match_the_requests(served, agent_generator):
    (episode, _) = run(
        served, agent_generator(f"{AGENTS}:miscounted", max_env_failure_fraction=1.0), PROMPTS[:1]
    ).episodes
    assert episode.stop_reason == "error" and "2 per-request rewards for 1 recorded requests" in episode.error


def test_an_async_agent_that_blocks_its_loop_still_finishes(served, agent_generator):
    """Async agents run on a loop of their own, so a blocking call stalls them, not the endpoint."""
    out = run(served, agent_generator(f"{AGENTS}:blocking"), PROMPTS[:1])
    assert [e.stop_reason for e in out.episodes] == ["done", "done"]


def test_a_training_session_asks_for_one_answer_per_request(served, agent_generator):
    out = run(served, agent_generator(f"{AGENTS}:best_of_two"), PROMPTS[:1])
    assert [e.stop_reason for e in out.episodes] == ["empty", "empty"]


def test_requests_outside_training_sessions_are_served_as_before(served, agent_generator):
    """A session id of another harness (or none) is neither recorded nor refused."""
    _, server = served
    agent_generator(f"{AGENTS}:silent")
    body = {"model": server.model_name, "prompt": [1, 20, 21], "max_tokens": 2, "temperature": 0}
    headers = {"Authorization": "Bearer secret", "X-Session-Id": "my-harness-1"}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200 and len(response.json()["choices"][0]["token_ids"]) == 2


def test_a_paused_endpoint_holds_agent_requests_and_the_episodes_finish(served, agent_generator):
    """As during a weight sync: agents' requests wait while paused, none fails."""
    loop, server = served
    generator = agent_generator(f"{AGENTS}:chatty", max_turns=3)
    loop.run(server.pause())
    future = asyncio.run_coroutine_threadsafe(generator.agenerate(PROMPTS[:1]), loop.loop)
    with pytest.raises(TimeoutError):
        future.result(timeout=1.5)
    loop.run(server.resume())
    out = future.result(timeout=60)
    assert [e.stop_reason for e in out.episodes] == ["done", "done"]


def test_a_bare_reward_goes_to_the_last_request_and_bad_results_are_named():
    assert turn_rewards(2, 3) == [0.0, 0.0, 2.0] and turn_rewards(1.0, 0) == []
    with pytest.raises(ValueError, match=r"returned 'won'; return an AgentResult\(reward=...\) or a number"):
        turn_rewards("won", 1)


def test_the_openai_client_is_shared_on_a_loop_and_not_across_loops():
    info = ClientInfo("http://127.0.0.1:1/v1", "secret", "tiny", "s0")

    async def clients():
        return info.openai_client(), replace(info, session_id="s1").openai_client()

    first, second = asyncio.run(clients())
    assert first is second and first.base_url == "http://127.0.0.1:1/v1/" and first.max_retries == 0
    assert asyncio.run(clients())[0] is not first, "a client is bound to the loop it was made on"


def test_a_missing_agent_is_a_config_error(served, tokenizer):
    _, server = served
    with pytest.raises(
        ConfigError, match=r"generator.agent='tests.train.generator.user_agents:gone'.* no attribute"
    ):
        AgentGenerator(server, tokenizer, GeneratorConfig(agent=f"{AGENTS}:gone"), GUESS_ENV)


def test_a_generator_that_returns_the_wrong_episodes_is_named(served, tokenizer):
    loop, server = served
    rows = parse_rows(guess_number.make_dataset(2, seed=0), "guess")
    cfg = GeneratorConfig(n_samples_per_prompt=2)
    good = user_generators.OneTurn(server.client, tokenizer, cfg, GUESS_ENV)
    out = loop.run(generate_checked(good, rows, ["a", "b"], 2))
    assert [e.trajectory.uid for e in out.episodes] == ["a", "a", "b", "b"]
    short = user_generators.Short(server.client, tokenizer, cfg, GUESS_ENV)
    with pytest.raises(RuntimeError, match=r"Short.agenerate returned episodes of uids \['a', 'a', 'b'\]"):
        loop.run(generate_checked(short, rows, ["a", "b"], 2))
