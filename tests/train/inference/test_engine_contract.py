"""The engine contract, checked the same way for the vllm and hf backends (one real engine actor each)."""

import asyncio
import re

import pytest
import ray
import torch

from skyrl.train.inference import SamplingParams, WeightUpdateError
from skyrl.train.inference.shared_weights import SharedBuffer, packed_nbytes
from skyrl.train.inference.weights import stream_spec

from ..generator.test_rollout import PROMPTS as EPISODE_PROMPTS
from ..generator.test_rollout import assert_token_exact, manager
from .conftest import (
    join_broadcast_sender,
    layer_groups,
    perturbed_copy,
    reference_logprobs,
    share_from_driver,
    start_client,
)

# Greedy decoding of the seed-0 tiny model repeats the last prompt token and never emits eos.
LOOP_PROMPT = [1, 20, 21]
PROMPTS = [[1, 10, 11, 12], [1, 20], [5, 6, 7, 8, 9, 10, 11, 40, 41, 42]]


@pytest.fixture(scope="module", params=["vllm", "hf"])
def client(request, ray_cluster, tiny_model_path):
    client = start_client(request.param, tiny_model_path)
    yield client
    client.shutdown()


def generate(client, prompt, params):
    return asyncio.run(client.generate(prompt, params))


def generate_all(client, prompts, params):
    async def run():
        return await asyncio.gather(*(client.generate(p, params) for p in prompts))

    return asyncio.run(run())


def assert_logprobs_match(model, prompt, out, temperature, top_k=None):
    assert out.logprobs is not None and len(out.logprobs) == len(out.response_ids)
    expected = reference_logprobs(model, prompt, out.response_ids, temperature, top_k)
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


def test_max_tokens_ends_the_response_with_reason_length(client):
    out = generate(client, LOOP_PROMPT, SamplingParams(temperature=0, max_tokens=7))
    assert out.response_ids == [LOOP_PROMPT[-1]] * 7
    assert out.stop_reason == "length"


def test_the_rollout_managers_multi_turn_episodes_are_token_exact(client, tokenizer):
    out = manager(client, tokenizer).generate(EPISODE_PROMPTS[:1])
    assert len(out.episodes) == 3
    for episode in out.episodes:
        assert episode.stop_reason == "done" and episode.num_turns == 3 and episode.reward == 1.0
        assert_token_exact(episode, tokenizer)
    assert out.metrics["episode/turns"] == 3.0 and out.metrics["reward/mean"] == 1.0


def test_stop_token_id_ends_the_response_and_is_its_last_token(client):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
    full = generate(client, PROMPTS[0], params)
    stop_id = full.response_ids[3]
    cut = full.response_ids.index(stop_id) + 1
    out = generate(
        client, PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=12, seed=7, stop_token_ids=[stop_id])
    )
    assert out.response_ids == full.response_ids[:cut]
    assert out.stop_reason == "stop"


def test_stop_string_ends_the_response_at_the_token_that_completes_it(client, tokenizer):
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=11)
    full = generate(client, PROMPTS[2], params).response_ids

    def text(n):
        return tokenizer.decode(full[:n], skip_special_tokens=True)

    def candidate(j):  # 2 printable characters that first appear once token j is generated
        s = text(j + 1)[-2:]
        return s.isprintable() and s.strip() and "\ufffd" not in s and s not in text(j)

    j = next(j for j in range(2, len(full)) if candidate(j))
    stop = text(j + 1)[-2:]
    out = generate(client, PROMPTS[2], SamplingParams(temperature=1.0, max_tokens=24, seed=11, stop=[stop]))
    assert out.response_ids == full[: j + 1]
    assert out.stop_reason == "stop"


@pytest.mark.parametrize(
    ("temperature", "top_k"),
    [(1.0, None), (0.7, None), (0.0, None), (0.8, 20)],
    ids=["t1", "t0.7", "greedy", "topk"],
)
def test_sampled_token_logprobs_match_an_hf_forward(client, reference_model, temperature, top_k):
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=16, seed=3)
    outputs = generate_all(
        client, PROMPTS, params
    )  # concurrent, different prompt lengths: batched and padded
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.response_ids
        assert_logprobs_match(reference_model, prompt, out, temperature, top_k)


def test_logprobs_off_returns_none(client):
    out = generate(client, PROMPTS[0], SamplingParams(max_tokens=4, logprobs=False))
    assert out.logprobs is None and len(out.response_ids) >= 1


def compiled_frames(_engine) -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def test_a_cpu_engine_serves_logprobs_without_compiling(client):
    """vLLM compiles a helper of its sampler (the sampled tokens' logprob ranks); an eager CPU engine runs
    it eagerly, as its first request with logprobs would otherwise take ~2 s of inductor set-up."""
    out = generate(client, PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=4))
    assert out.logprobs is not None
    assert ray.get(client.engines[0].__ray_call__.remote(compiled_frames)) == 0


def test_update_weights_switches_to_the_perturbed_model(client, reference_model):
    perturbed = perturbed_copy(reference_model)
    # 300 tokens fill whole KV blocks (128 tokens on CPU), so a stale prefix cache would be reused after the update.
    prompt = [(7 * i) % 500 + 3 for i in range(300)]
    params = SamplingParams(temperature=0.9, max_tokens=8, seed=5)
    before = generate(client, prompt, params)
    assert_logprobs_match(reference_model, prompt, before, 0.9)
    version = client.weight_version + 1
    asyncio.run(client.update_weights(perturbed.state_dict(), version))
    try:
        assert client.weight_version == version
        after = generate(client, prompt, params)
        assert after.weight_version == version
        assert_logprobs_match(perturbed, prompt, after, 0.9)
        assert [h.weight_version for h in asyncio.run(client.health())] == [version]
    finally:
        asyncio.run(client.update_weights(reference_model.state_dict(), version + 1))
    assert_logprobs_match(reference_model, prompt, generate(client, prompt, params), 0.9)


def test_update_weights_while_a_request_runs_lets_it_finish(client, reference_model):
    perturbed = perturbed_copy(reference_model, seed=1)

    async def run():
        running = asyncio.ensure_future(
            client.generate(LOOP_PROMPT, SamplingParams(temperature=0, max_tokens=400))
        )
        while sum(h.num_in_flight for h in await client.health()) == 0:
            await asyncio.sleep(0.01)
        await client.update_weights(perturbed.state_dict(), client.weight_version + 1)
        try:
            return await running, (await client.health())[0].num_in_flight
        finally:
            await client.update_weights(reference_model.state_dict(), client.weight_version + 1)

    out, in_flight = asyncio.run(run())
    assert out.stop_reason in ("length", "stop") and 1 <= len(out.response_ids) <= 400
    assert in_flight == 0


@pytest.fixture(scope="module")
def sender(client):
    sender = join_broadcast_sender(client)
    yield sender
    ray.kill(sender)


def stream(client, request, path, groups, spec, version):
    """Send `groups` (announced as `spec`) by broadcast from a sender actor, or through shared memory."""
    if path == "broadcast":
        sender = request.getfixturevalue("sender")
        return asyncio.run(client.broadcast_weights(spec, version, lambda: sender.send.remote(groups)))
    return asyncio.run(client.share_weights(spec, version, share_from_driver(groups, version)))


@pytest.mark.parametrize("path", ["broadcast", "ipc"])
def test_streamed_weights_switch_to_the_perturbed_model_group_by_group(
    client, reference_model, request, path
):
    perturbed = perturbed_copy(reference_model, seed=3)
    prompt = [(5 * i) % 500 + 3 for i in range(300)]  # whole KV blocks: a stale prefix cache would show
    params = SamplingParams(temperature=0.9, max_tokens=8, seed=5)
    generate(client, prompt, params)
    try:
        groups = layer_groups(perturbed)
        version = client.weight_version + 1
        stream(client, request, path, groups, stream_spec(groups), version)
        assert client.weight_version == version
        assert [h.weight_version for h in asyncio.run(client.health())] == [version]
        after = generate(client, prompt, params)
        assert after.weight_version == version
        assert_logprobs_match(perturbed, prompt, after, 0.9)
    finally:
        asyncio.run(client.update_weights(reference_model.state_dict(), client.weight_version + 1))


@pytest.mark.parametrize("path", ["broadcast", "ipc"])
def test_bad_stream_spec_is_rejected_before_anything_is_sent(client, reference_model, request, path):
    request.getfixturevalue("sender")  # the broadcast group is joined: only the spec is wrong
    spec = stream_spec(layer_groups(reference_model))
    spec[1] = [(name, dtype, (3, 3)) for name, dtype, _ in spec[1]]
    version = client.weight_version
    sent = []
    sync = client.broadcast_weights if path == "broadcast" else client.share_weights
    with pytest.raises(WeightUpdateError, match=re.escape("has shape (3, 3)")):
        asyncio.run(sync(spec, version + 1, lambda *engines: sent.append(1)))
    assert not sent and client.weight_version == version
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=2)
    assert_logprobs_match(reference_model, PROMPTS[0], generate(client, PROMPTS[0], params), 1.0)


def test_a_shared_group_unlike_its_spec_is_refused_on_arrival(client, reference_model):
    version = client.weight_version
    halves = {name: t[: t.shape[0] // 2] for name, t in layer_groups(reference_model)[0].items()}
    buffer = SharedBuffer(packed_nbytes(halves.values()), torch.device("cpu"))
    try:
        with pytest.raises(WeightUpdateError, match="has shape"):
            ray.get(client.engines[0].load_shared_weights.remote(buffer.share(halves), version + 1))
    finally:
        buffer.close()
    assert [h.weight_version for h in asyncio.run(client.health())] == [version]
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=2)
    assert_logprobs_match(reference_model, PROMPTS[0], generate(client, PROMPTS[0], params), 1.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda sd: {**sd, "model.embed_tokens.weight": torch.zeros(3, 3)}, "has shape (3, 3)"),
        (lambda sd: {**sd, "model.layers.9.mlp.up_proj.weight": torch.zeros(4)}, "unknown names"),
        (
            lambda sd: {
                "model.layers.0.self_attn.q_proj.weight": sd["model.layers.0.self_attn.q_proj.weight"]
            },
            "fused",
        ),
        (
            lambda sd: {**sd, "model.norm.weight": sd["model.norm.weight"].long()},
            "not a floating-point dtype",
        ),
        (lambda sd: {}, "empty"),
    ],
    ids=["wrong-shape", "unknown-name", "partial-qkv", "int-dtype", "empty"],
)
def test_malformed_weight_update_is_rejected_and_the_engine_keeps_serving(
    client, reference_model, change, message
):
    version = client.weight_version
    bad = change({k: v * 2 for k, v in reference_model.state_dict().items()})
    with pytest.raises(WeightUpdateError, match=re.escape(message)):
        asyncio.run(client.update_weights(bad, version + 1))
    assert client.weight_version == version
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=2)
    assert_logprobs_match(reference_model, PROMPTS[0], generate(client, PROMPTS[0], params), 1.0)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([1, 10**6], "outside the vocabulary"), ([1] * 5000, "maximum model length"), ([], "empty")],
    ids=["out-of-vocab", "too-long", "empty"],
)
def test_invalid_prompt_is_rejected_and_the_engine_keeps_serving(client, prompt, message):
    with pytest.raises(ValueError, match=message):
        generate(client, prompt, SamplingParams(max_tokens=4))
    assert generate(client, LOOP_PROMPT, SamplingParams(temperature=0, max_tokens=3)).response_ids == [21] * 3


def test_sleep_aborts_requests_in_flight_and_wake_up_resumes(client):
    async def run():
        long = asyncio.ensure_future(
            client.generate(LOOP_PROMPT, SamplingParams(temperature=0, max_tokens=2000))
        )
        while sum(h.num_in_flight for h in await client.health()) == 0:
            await asyncio.sleep(0.01)
        await client.sleep()
        aborted = await long
        with pytest.raises(RuntimeError, match="asleep"):
            await client.generate(LOOP_PROMPT, SamplingParams(max_tokens=2))
        assert all(h.asleep for h in await client.health())
        await client.wake_up()
        return aborted, await client.generate(LOOP_PROMPT, SamplingParams(temperature=0, max_tokens=3))

    aborted, resumed = asyncio.run(run())
    assert aborted.stop_reason == "abort" and aborted.response_ids == [] and aborted.logprobs is None
    assert resumed.response_ids == [21] * 3 and resumed.stop_reason == "length"


@torch.no_grad()
def test_allowed_token_ids_restrict_sampling_and_renormalise_logprobs(client, reference_model):
    allowed = [17, 18, 19, 20, 21]
    params = SamplingParams(temperature=0.8, max_tokens=6, allowed_token_ids=allowed)
    outs = generate_all(client, PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.response_ids and set(out.response_ids) <= set(allowed)
        ids = torch.tensor([prompt + out.response_ids])
        logits = reference_model(ids).logits[0, len(prompt) - 1 : -1].float() / 0.8
        mask = torch.full_like(logits, float("-inf"))
        mask[:, allowed] = 0
        expected = (logits + mask).log_softmax(-1).gather(-1, torch.tensor(out.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


GRAMMAR = 'root ::= ("yes" | "no") ", " ("red" | "blue" | "green")'


@torch.no_grad()
def test_a_grammar_constrains_the_text_and_renormalises_logprobs_over_what_it_allows(
    client, reference_model, tokenizer
):
    """Each step samples from the model's distribution masked to the tokens the grammar allows next (a
    stop token once it is complete), and the logprobs are of that masked distribution: replayed here
    with xgrammar's own matcher over an HF forward."""
    import xgrammar as xgr

    outs = generate_all(client, PROMPTS, SamplingParams(temperature=0.8, max_tokens=16, grammar=GRAMMAR))
    vocab_size = reference_model.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_grammar(GRAMMAR)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.stop_reason == "stop" and out.response_ids[-1] == tokenizer.eos_token_id
        assert re.fullmatch(r"(yes|no), (red|blue|green)", tokenizer.decode(out.response_ids[:-1]))
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[tokenizer.eos_token_id])
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        masks = torch.zeros(len(out.response_ids), vocab_size)
        for step, token in enumerate(out.response_ids):
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(masks[step : step + 1], bitmask)
            assert matcher.accept_token(token)
        assert matcher.is_terminated()
        ids = torch.tensor([prompt + out.response_ids])
        logits = reference_model(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = (
            ((logits + masks) / 0.8).log_softmax(-1).gather(-1, torch.tensor(out.response_ids)[:, None])
        )
        torch.testing.assert_close(torch.tensor(out.logprobs), expected[:, 0], atol=1e-4, rtol=0)


def test_an_invalid_grammar_is_refused_and_the_engine_keeps_serving(client):
    with pytest.raises(ValueError, match="grammar"):
        generate(client, PROMPTS[0], SamplingParams(max_tokens=4, grammar="root ::= (unclosed"))
    assert generate(client, PROMPTS[0], SamplingParams(temperature=0, max_tokens=2)).stop_reason == "length"
