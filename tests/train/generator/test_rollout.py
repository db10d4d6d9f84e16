"""The rollout manager against a real tiny model behind a real engine actor (token-exact episodes on
every backend: the engine contract's tests)."""

import asyncio
import re
import threading

import psutil
import pytest

from skyrl.envs import BaseTextEnv, guess_number
from skyrl.train.dataset.preprocess import trajectories_to_sequences
from skyrl.train.dataset.prompt_dataset import parse_rows
from skyrl.train.generator.rollout import ChatTemplateDelta, RolloutManager, allowed_token_ids
from skyrl.train.inference import InferenceEngineClient, InferenceEngineConfig, SamplingParams
from skyrl.train.schema import EnvironmentConfig, GeneratorConfig, SamplingConfig
from skyrl.train.utils.errors import ConfigError
from tests.envs import user_envs

CHATTY = "tests.envs.user_envs:ChattyEnv"
FLAKY = "tests.envs.user_envs:FlakyEnv"
PROMPTS = parse_rows(
    [
        {"prompt": [{"role": "system", "content": "Play."}, {"role": "user", "content": "Go."}]},
        {"prompt": "Start.", "fail": True},
    ],
    "test",
)


def env_processes() -> set[int]:
    """The live environment worker processes of this test process."""
    return {p.pid for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())}


def manager(client, tokenizer, env_class=CHATTY, env_config=None, **overrides):
    """A rollout manager over `generator` settings `overrides` and env `env_class`."""
    settings = {"n_samples_per_prompt": 3, "max_turns": 3, "max_generate_length": 6}
    env = EnvironmentConfig(env_class, {env_class: env_config or {"turns": 3}})
    return RolloutManager(client, tokenizer, GeneratorConfig(**{**settings, **overrides}), env)


def assert_token_exact(episode, tokenizer):
    """Each turn's context = previous context + engine response + chat-template observation, and the
    decoded conversation equals the chat template applied to the messages."""
    turns = episode.trajectory.turns
    messages = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Go."}]
    for k, turn in enumerate(turns):
        assert turn.loss_mask == [1] * len(turn.response_ids)
        assert len(turn.logprobs) == len(turn.response_ids)
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert tokenizer.decode(turn.context_ids) == rendered
        if k + 1 < len(turns):
            nxt = turns[k + 1].context_ids
            assert (
                nxt[: len(turn.context_ids) + len(turn.response_ids)] == turn.context_ids + turn.response_ids
            )
            content = (
                turn.response_ids[:-1]
                if turn.response_ids[-1] == tokenizer.eos_token_id
                else turn.response_ids
            )
            messages += [
                {"role": "assistant", "content": tokenizer.decode(content)},
                {"role": "user", "content": "Again."},
            ]


def test_loss_masked_tokens_decode_to_exactly_the_model_outputs(hf_client, tokenizer):
    (episode,) = manager(hf_client, tokenizer, n_samples_per_prompt=1).generate(PROMPTS[:1]).episodes
    (whole,) = trajectories_to_sequences([episode.trajectory], step_wise=False)
    trained = [t for t, m in zip(whole.response_ids, whole.loss_mask, strict=True) if m]
    assert trained == [t for turn in episode.trajectory.turns for t in turn.response_ids]
    assert sum(whole.loss_mask) < len(whole.response_ids)  # observation tokens are there, masked out


def test_stepwise_decomposition_of_real_episodes(hf_client, tokenizer):
    out = manager(hf_client, tokenizer).generate(PROMPTS[:1] * 2, uids=["a", "b"])
    seqs = trajectories_to_sequences(out.trajectories, step_wise=True)
    assert len(seqs) == sum(e.num_turns for e in out.episodes) == 18
    assert [s.uid for s in seqs] == ["a"] * 9 + ["b"] * 9
    assert [s.is_last_step for s in seqs[:3]] == [False, False, True]
    assert [s.trajectory_id for s in seqs[:4]] == ["a/0"] * 3 + ["a/1"]


def test_an_hf_engine_waits_for_more_requests_unless_told_that_every_episode_waits(
    ray_cluster, tiny_model_path, tokenizer
):
    """The hf engine starts a batch once no request has come for `hf_batch_wait_s`; a rollout tells it when
    every running episode waits for its turn's output (`InferenceEngineClient.flush`), so the turn starts at
    once. With a 10-minute window, three turns of six episodes end only if every turn was flushed; a lone
    request nobody flushes stays queued until a flush."""
    cfg = InferenceEngineConfig(backend="hf", device="cpu", hf_batch_wait_s=600)
    client = InferenceEngineClient.from_config(cfg, str(tiny_model_path))
    try:
        out = asyncio.run(asyncio.wait_for(manager(client, tokenizer).agenerate(PROMPTS[:1] * 2), 120))
        assert [e.num_turns for e in out.episodes] == [3] * 6

        async def lone_request():
            request = asyncio.ensure_future(client.generate([1, 10], SamplingParams(max_tokens=2)))
            await asyncio.sleep(0.5)
            queued = not request.done()
            client.flush()
            return queued, await asyncio.wait_for(request, 120)

        queued, output = asyncio.run(lone_request())
        assert queued and output.response_ids
    finally:
        client.shutdown()


def test_builtin_env_from_config_runs(hf_client, tokenizer):
    from skyrl.envs import guess_number

    rows = parse_rows(guess_number.make_dataset(2, seed=0), "guess")
    cfg = GeneratorConfig(n_samples_per_prompt=2, max_turns=4, max_generate_length=2)
    out = RolloutManager(hf_client, tokenizer, cfg, EnvironmentConfig(env_class="unused")).generate(rows)
    assert len(out.episodes) == 4
    assert all(e.stop_reason in ("done", "max_turns") for e in out.episodes)
    assert {"reward/mean", "reward/pass@2", "env/guesses", "timing/generate_s"} <= set(out.metrics)


@pytest.mark.parametrize("mode", ["mask", "zero_reward"])
def test_a_crashing_env_fails_its_episode_only(hf_client, tokenizer, mode):
    """Default `mask`: the failed episodes' turns leave the loss; `zero_reward` trains on them with reward 0."""
    out = manager(hf_client, tokenizer, env_class=FLAKY, env_failure=mode).generate(PROMPTS)
    good, bad = out.episodes[:3], out.episodes[3:]
    assert all(e.stop_reason == "done" and e.reward == 1.0 for e in good)
    assert all(t.loss_mask == [1] * len(t.response_ids) for e in good for t in e.trajectory.turns)
    for e in bad:
        assert e.stop_reason == "error" and e.reward == 0.0 and "simulated env crash" in e.error
        (turn,) = e.trajectory.turns  # FlakyEnv raises on its second step: one generated turn
        assert turn.reward == 0.0 and len(turn.response_ids) > 0
        assert turn.loss_mask == [0 if mode == "mask" else 1] * len(turn.response_ids)
    assert out.metrics["episode/env_failures"] == 3.0
    assert out.metrics["reward/mean"] == 0.5
    sequences = trajectories_to_sequences(out.trajectories, step_wise=True)
    trained = {s.trajectory_id for s in sequences if any(s.loss_mask)}
    assert trained == {e.trajectory.trajectory_id for e in (good if mode == "mask" else out.episodes)}


def test_an_env_call_past_its_timeout_fails_its_episode_and_does_not_hold_up_the_batch(hf_client, tokenizer):
    rows = parse_rows([{"prompt": "Go.", "hang": True}, {"prompt": "Go."}], "test")
    hanging = "tests.envs.user_envs:HangingEnv"
    env = EnvironmentConfig(hanging, {hanging: {"turns": 2}}, timeout_s=1.0)
    cfg = GeneratorConfig(
        n_samples_per_prompt=1, max_turns=2, max_generate_length=4, max_env_failure_fraction=0.5
    )
    user_envs.RELEASE.clear()
    try:
        hung, fine = RolloutManager(hf_client, tokenizer, cfg, env).generate(rows).episodes
        assert not user_envs.FINISHED  # the batch did not wait for the stuck call
    finally:
        user_envs.RELEASE.set()
    assert hung.stop_reason == "error" and "did not return within environment.timeout_s=1.0" in hung.error
    assert all(not any(t.loss_mask) for t in hung.trajectory.turns)
    assert fine.stop_reason == "done" and fine.reward == 1.0


def test_an_env_with_base_text_envs_constructor_is_built_without_a_thread_once_one_has_imported_it(
    hf_client, tokenizer, monkeypatch
):
    """BaseTextEnv's constructor returns at once, as its default methods do: after the first batch such
    envs are built on the event loop (the first turns of a batch reach the engine together). A
    constructor of the env's own may block: it always runs on an env thread, under the timeout."""
    built_on = []  # the thread of every BaseTextEnv.__init__
    original = BaseTextEnv.__init__

    def recording_init(self, *args):
        built_on.append(threading.current_thread().name)
        original(self, *args)

    monkeypatch.setattr(BaseTextEnv, "__init__", recording_init)
    for name, threads_later in [("EchoLengthEnv", False), ("OwnInitEnv", True)]:
        mgr = manager(hf_client, tokenizer, env_class=f"tests.envs.user_envs:{name}", max_turns=1)
        for batch in range(2):
            built_on.clear()
            assert len(mgr.generate(PROMPTS).episodes) == 6
            on_threads = [t.startswith("skyrl-env") for t in built_on]
            assert on_threads == [batch == 0 or threads_later] * 6, (name, batch, built_on)


def test_too_many_env_failures_fail_the_step_quoting_the_error(hf_client, tokenizer):
    mgr = manager(hf_client, tokenizer, env_class=FLAKY, max_env_failure_fraction=0.25)
    with pytest.raises(RuntimeError, match=r"3 of 6 episodes failed .* simulated env crash"):
        mgr.generate(PROMPTS)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_an_unknown_env_fails_with_the_registered_names(hf_client, tokenizer, executor):
    mgr = manager(hf_client, tokenizer, env_class="sokoban", env_executor=executor)
    with pytest.raises(RuntimeError, match=r"unknown environment 'sokoban'; registered: \["):
        mgr.generate(PROMPTS[:1])


def test_env_processes_play_the_same_episodes_as_env_threads(hf_client, tokenizer):
    """Greedy guess_number games, one per hidden number: where the envs run changes nothing."""
    env = EnvironmentConfig(
        "guess_number", {"guess_number": {"max_turns": 4, "allowed_tokens": [str(i) for i in range(1, 9)]}}
    )
    rows = parse_rows([{**guess_number.make_dataset(1)[0], "target": t} for t in range(1, 9)], "guess")
    settings = {"n_samples_per_prompt": 2, "max_turns": 4, "max_generate_length": 1, "max_input_length": 256}
    greedy = SamplingConfig(temperature=0.0)
    processes = GeneratorConfig(**settings, env_executor="process", env_workers=3)
    mgr = RolloutManager(hf_client, tokenizer, processes, env)
    try:
        ours = mgr.generate(rows, sampling=greedy).episodes
    finally:
        mgr.close()
    theirs = RolloutManager(hf_client, tokenizer, GeneratorConfig(**settings), env).generate(
        rows, sampling=greedy
    )
    assert 0 < sum(e.reward for e in ours) < len(ours)  # some games won, some lost
    assert max(e.num_turns for e in ours) > 1
    for a, b in zip(ours, theirs.episodes, strict=True):
        assert (a.stop_reason, a.reward, a.env_metrics) == (b.stop_reason, b.reward, b.env_metrics)
        assert [(t.context_ids, t.response_ids, t.reward) for t in a.trajectory.turns] == [
            (t.context_ids, t.response_ids, t.reward) for t in b.trajectory.turns
        ]


def test_an_env_that_raises_in_a_process_fails_its_episode_as_in_a_thread(hf_client, tokenizer):
    mgr = manager(hf_client, tokenizer, env_class=FLAKY, env_executor="process", env_workers=2)
    try:
        ours = mgr.generate(PROMPTS).episodes
    finally:
        mgr.close()
    theirs = manager(hf_client, tokenizer, env_class=FLAKY).generate(PROMPTS).episodes
    assert [(e.stop_reason, e.error) for e in ours] == [(e.stop_reason, e.error) for e in theirs]
    assert ours[3].error == "FlakyEnv.step raised RuntimeError: simulated env crash"


def test_an_env_process_that_dies_fails_only_its_episodes_and_is_replaced(hf_client, tokenizer):
    crashing = "tests.envs.user_envs:CrashingEnv"
    rows = parse_rows(
        [{"prompt": "Go."}, {"prompt": "Go.", "crash": "exit"}, {"prompt": "Go.", "crash": "segfault"}],
        "test",
    )
    env = EnvironmentConfig(crashing, {crashing: {"turns": 2}}, timeout_s=20.0)
    cfg = GeneratorConfig(
        n_samples_per_prompt=1,
        max_turns=2,
        max_generate_length=4,
        max_env_failure_fraction=1.0,
        env_executor="process",
        env_workers=3,  # one env per process
    )
    mgr = RolloutManager(hf_client, tokenizer, cfg, env)
    try:
        fine, exited, segfaulted = mgr.generate(rows).episodes
        again = mgr.generate(rows[:1] * 3).episodes  # the dead processes' slots take new ones
    finally:
        mgr.close()
    assert fine.stop_reason == "done" and fine.reward == 1.0
    process = r"CrashingEnv.step: its environment process \(pid \d+\)"
    assert exited.stop_reason == "error" and re.fullmatch(f"{process} died with exit code 3", exited.error)
    assert segfaulted.stop_reason == "error"
    assert re.fullmatch(f"{process} was killed by signal 11 \\(Segmentation fault\\)", segfaulted.error)
    for e in (exited, segfaulted):
        (turn,) = e.trajectory.turns  # the first step returned, the second killed the process
        assert e.reward == 0.0 and not any(turn.loss_mask)
    assert [(e.stop_reason, e.reward) for e in again] == [("done", 1.0)] * 3


def test_an_env_process_past_its_timeout_is_killed_and_replaced(hf_client, tokenizer):
    rows = parse_rows([{"prompt": "Go.", "hang": True}, {"prompt": "Go."}], "test")
    hanging = "tests.envs.user_envs:HangingEnv"  # in a process, nothing releases its step for 30 s
    env = EnvironmentConfig(hanging, {hanging: {"turns": 2}}, timeout_s=3.0)
    cfg = GeneratorConfig(
        n_samples_per_prompt=1, max_turns=2, max_generate_length=4, env_executor="process", env_workers=2
    )
    mgr = RolloutManager(hf_client, tokenizer, cfg, env)
    try:
        mgr.generate(rows[1:] * 2)  # starts both processes, outside the timed calls
        started = env_processes()
        hung, fine = mgr.generate(rows).episodes  # one env per process
        left = env_processes()
        again = mgr.generate(rows[1:] * 2).episodes
        replaced = env_processes()
    finally:
        mgr.close()
    assert len(started) == 2 and len(left) == 1 and left < started  # the stuck process is gone
    assert len(replaced) == 2 and left < replaced
    assert hung.stop_reason == "error"
    assert hung.error == "HangingEnv.step did not return within environment.timeout_s=3.0"
    assert all(not any(t.loss_mask) for t in hung.trajectory.turns)
    assert fine.stop_reason == "done" and fine.reward == 1.0
    assert [(e.stop_reason, e.reward) for e in again] == [("done", 1.0)] * 2


def test_context_over_max_input_length_stops_with_length(hf_client, tokenizer):
    (episode,) = (
        manager(hf_client, tokenizer, n_samples_per_prompt=1, max_input_length=30)
        .generate(PROMPTS[:1])
        .episodes
    )
    assert episode.stop_reason == "length"
    assert all(len(t.context_ids) + len(t.response_ids) <= 30 for t in episode.trajectory.turns)


def test_an_action_space_belongs_to_the_env_it_was_written_for(tokenizer):
    digits = {"guess_number": {"allowed_tokens": ["1", "2"]}}
    ids = allowed_token_ids(tokenizer, EnvironmentConfig("guess_number", digits))
    assert tokenizer.convert_ids_to_tokens(list(ids)) == ["1", "2"]
    # another env keeps guess_number's section in the config but samples freely
    assert allowed_token_ids(tokenizer, EnvironmentConfig("my_env:MyEnv", digits)) == ()


def test_an_action_space_entry_of_several_tokens_names_its_key(tokenizer):
    env = EnvironmentConfig("guess_number", {"guess_number": {"allowed_tokens": ["Guess the number"]}})
    with pytest.raises(ConfigError, match=r"environment.config.guess_number.allowed_tokens entry 'Guess"):
        allowed_token_ids(tokenizer, env)


def test_cached_chat_template_renders_equal_fresh_ones_and_callers_cannot_change_them(tokenizer):
    template = ChatTemplateDelta(tokenizer)
    messages = [{"role": "user", "content": "Guess a number."}]
    observation = [{"role": "user", "content": "Higher."}]
    first = template.prompt(messages)
    first.append(0)  # a caller extends its context in place
    assert template.prompt(messages) == first[:-1] == ChatTemplateDelta(tokenizer).prompt(messages)
    assert template.observation(observation) == ChatTemplateDelta(tokenizer).observation(observation)
    unhashable = [{"role": "user", "content": "Guess a number.", "tags": ["a"]}]  # rendered, not cached
    assert template.prompt(unhashable) == template.prompt(messages)
