"""The client over two real engine actors: sticky sessions, least-loaded spread, bounded concurrency, weight sync."""

import asyncio

import pytest
import torch

from skyrl.train.inference import InferenceEngineClient, SamplingParams

from .conftest import perturbed_copy, reference_logprobs, start_client

PARAMS = SamplingParams(temperature=1.0, max_tokens=4, seed=0)


@pytest.fixture(scope="module")
def client(ray_cluster, tiny_model_path):
    client = start_client("hf", tiny_model_path, num_engines=2)
    yield client
    client.shutdown()


def served(client) -> list[int]:
    return [h.num_served for h in asyncio.run(client.health())]


def test_all_turns_of_a_trajectory_go_to_one_engine(client):
    for trajectory in ["traj-a", "traj-b", "traj-c"]:
        before = served(client)
        context = [1, 10, 11]
        for _ in range(3):  # a multi-turn episode: each turn extends the previous context
            out = asyncio.run(client.generate(context, PARAMS, session_id=trajectory))
            context = context + out.response_ids + [12]
        delta = sorted(a - b for a, b in zip(served(client), before, strict=True))
        assert delta == [0, 3], f"{trajectory} turns were served by engines with counts {delta}"


def test_concurrent_trajectories_spread_over_both_engines(client):
    before = served(client)

    async def run():
        await asyncio.gather(
            *(client.generate([1, 20 + i], PARAMS, session_id=f"spread-{i}") for i in range(8))
        )

    asyncio.run(run())
    assert [a - b for a, b in zip(served(client), before, strict=True)] == [4, 4]


def test_requests_sent_together_get_their_own_results_and_errors(client):
    """Concurrent requests travel to an engine in one call; each still gets its own response, and a
    bad prompt fails only its own request."""
    prompts = [[1, 40 + i] for i in range(6)] + [[1, 10**6]]
    greedy = SamplingParams(temperature=0, max_tokens=3)

    async def run():
        return await asyncio.gather(
            *(client.generate(p, greedy, session_id="together") for p in prompts), return_exceptions=True
        )

    *outputs, error = asyncio.run(run())
    assert isinstance(error, ValueError) and "outside the vocabulary" in str(error)
    alone = [asyncio.run(client.generate(p, greedy)).response_ids for p in prompts[:-1]]
    assert [o.response_ids for o in outputs] == alone


def test_requests_without_a_session_spread_over_both_engines(client):
    fresh = InferenceEngineClient(client.engines)
    before = served(client)
    for i in range(4):  # sequential: always a tie on load, broken by how often each engine was picked
        asyncio.run(fresh.generate([1, 30 + i], PARAMS))
    assert [a - b for a, b in zip(served(client), before, strict=True)] == [2, 2]


def test_client_bounds_requests_in_flight(client):
    bounded = InferenceEngineClient(client.engines, max_concurrent_requests=2)
    peak = 0

    async def run():
        nonlocal peak
        requests = asyncio.gather(
            *(bounded.generate([1, 40 + i], SamplingParams(max_tokens=64)) for i in range(6))
        )
        while not requests.done():
            peak = max(peak, sum(h.num_in_flight for h in await bounded.health()))
            await asyncio.sleep(0.005)
        return await requests

    outputs = asyncio.run(run())
    assert len(outputs) == 6 and all(o.response_ids for o in outputs)
    assert 1 <= peak <= 2


def test_weight_update_reaches_every_engine_and_bumps_the_version(client, reference_model):
    perturbed = perturbed_copy(reference_model, seed=2)
    version = client.weight_version + 1
    asyncio.run(client.update_weights(perturbed.state_dict(), version))
    try:
        assert client.weight_version == version
        assert [h.weight_version for h in asyncio.run(client.health())] == [version, version]

        async def run():  # two concurrent sessions land on both engines
            return await asyncio.gather(
                *(client.generate([1, 50 + i], PARAMS, f"sync-{i}") for i in range(2))
            )

        before = served(client)
        for i, out in enumerate(asyncio.run(run())):
            assert out.weight_version == version
            expected = reference_logprobs(perturbed, [1, 50 + i], out.response_ids, 1.0)
            torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
        assert [a - b for a, b in zip(served(client), before, strict=True)] == [1, 1]
    finally:
        asyncio.run(client.update_weights(reference_model.state_dict(), version + 1))


def test_weight_version_must_increase(client, reference_model):
    with pytest.raises(ValueError, match="must be greater than the current"):
        asyncio.run(client.update_weights(reference_model.state_dict(), client.weight_version))
