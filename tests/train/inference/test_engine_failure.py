"""A killed engine actor fails its requests with an error naming it; the client restarts it with current weights
(or refuses to, when it keeps no copy of them)."""

import asyncio

import pytest
import ray
import torch

from skyrl.train.inference import EngineDeadError, SamplingParams
from skyrl.train.inference.weights import stream_spec

from .conftest import layer_groups, perturbed_copy, reference_logprobs, share_from_driver, start_client

LOOP_PROMPT = [1, 20, 21]


def test_killed_engine_fails_requests_clearly_and_restarts_with_current_weights(
    ray_cluster, tiny_model_path, reference_model
):
    """On vLLM. The hf engine's automatic restart with the current weights is the next tests' subject,
    through the same client code; a dead engine with no restarts left and `restart_engine` called by
    hand are checked on vLLM only."""
    client = start_client("vllm", tiny_model_path)
    try:
        perturbed = perturbed_copy(reference_model, seed=3)
        asyncio.run(client.update_weights(perturbed.state_dict(), 1))

        async def kill_during_a_request():
            running = asyncio.ensure_future(
                client.generate(LOOP_PROMPT, SamplingParams(temperature=0, max_tokens=2000), session_id="s")
            )
            while sum(h.num_in_flight for h in await client.health()) == 0:
                await asyncio.sleep(0.01)
            index = next(i for i, h in enumerate(await client.health()) if h.num_in_flight)
            ray.kill(client.engines[index])
            with pytest.raises(
                EngineDeadError,
                match=rf"(?s)inference engine {index} is dead.*`await client.restart_engine\({index}\)`",
            ):
                await running
            return index

        index = asyncio.run(kill_during_a_request())
        with pytest.raises(EngineDeadError, match=f"inference engine {index}"):  # sticky session, dead engine
            asyncio.run(client.generate(LOOP_PROMPT, SamplingParams(max_tokens=2), session_id="s"))
        with pytest.raises(EngineDeadError, match=f"inference engine {index}"):
            asyncio.run(client.health())

        asyncio.run(client.restart_engine(index))
        assert [h.weight_version for h in asyncio.run(client.health())] == [1]
        out = asyncio.run(client.generate([1, 10, 11], SamplingParams(max_tokens=8, seed=1), session_id="s"))
        assert out.weight_version == 1
        expected = reference_logprobs(perturbed, [1, 10, 11], out.response_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
    finally:
        client.shutdown()


def test_an_engine_updated_through_shared_memory_is_not_restarted_with_stale_weights(
    ray_cluster, tiny_model_path, reference_model
):
    client = start_client("hf", tiny_model_path)
    try:
        asyncio.run(client.update_weights(reference_model.state_dict(), 1))  # a copy the client keeps
        groups = layer_groups(perturbed_copy(reference_model, seed=2))
        asyncio.run(client.share_weights(stream_spec(groups), 2, share_from_driver(groups, 2)))
        with pytest.raises(
            RuntimeError, match=r"weight version 2, sent through shared memory, .*weight_sync=object_store"
        ):
            asyncio.run(client.restart_engine(0))
        assert [h.weight_version for h in asyncio.run(client.health())] == [2]
    finally:
        client.shutdown()


def test_a_dead_engine_is_restarted_and_its_request_issued_again_up_to_the_limit(
    ray_cluster, tiny_model_path, reference_model
):
    """generator.max_engine_restarts: a request whose engine dies is answered by the restarted engine,
    with the current weights and the same prompt (greedy: the answer an undisturbed engine gives)."""
    client = start_client("hf", tiny_model_path)
    client.max_restarts = 1
    params = SamplingParams(temperature=0, max_tokens=500)
    try:
        asyncio.run(client.update_weights(perturbed_copy(reference_model, seed=4).state_dict(), 1))

        async def kill_during_a_request():
            running = asyncio.ensure_future(client.generate(LOOP_PROMPT, params, session_id="s"))
            while sum(h.num_in_flight for h in await client.health()) == 0:
                await asyncio.sleep(0.01)
            ray.kill(client.engines[0])
            return await running

        out = asyncio.run(kill_during_a_request())
        assert client.restarts == 1 and out.weight_version == 1
        assert out.response_ids == asyncio.run(client.generate(LOOP_PROMPT, params)).response_ids
        with pytest.raises(
            EngineDeadError,
            match=r"engine 0 died again after 1 restart\(s\).*max_engine_restarts=1\); last cause",
        ):
            asyncio.run(kill_during_a_request())
    finally:
        client.shutdown()


def test_an_engine_found_dead_by_a_weight_update_is_restarted_and_updated(
    ray_cluster, tiny_model_path, reference_model
):
    """An engine that died between steps (no request noticed) is restarted by the next weight sync,
    which then reaches it too; without restarts left the sync raises naming the engine."""
    client = start_client("hf", tiny_model_path)
    client.max_restarts = 1
    try:
        asyncio.run(client.update_weights(reference_model.state_dict(), 1))
        ray.kill(client.engines[0])
        perturbed = perturbed_copy(reference_model, seed=5)
        asyncio.run(client.update_weights(perturbed.state_dict(), 2))
        assert client.restarts == 1
        assert [h.weight_version for h in asyncio.run(client.health())] == [2]
        out = asyncio.run(client.generate([1, 10, 11], SamplingParams(temperature=0, max_tokens=8)))
        expected = reference_logprobs(perturbed, [1, 10, 11], out.response_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
        ray.kill(client.engines[0])
        with pytest.raises(EngineDeadError, match=r"engine 0 died again after 1 restart\(s\)"):
            asyncio.run(client.update_weights(perturbed.state_dict(), 3))
    finally:
        client.shutdown()


def test_a_restart_outlives_the_request_that_started_it(ray_cluster, tiny_model_path, reference_model):
    """A request cancelled while it restarts its dead engine (e.g. a discarded asynchronous draw)
    leaves the restart running; the next request waits for it instead of starting a second one."""
    client = start_client("hf", tiny_model_path)
    client.max_restarts = 1
    params = SamplingParams(temperature=0, max_tokens=4)
    try:
        asyncio.run(client.update_weights(reference_model.state_dict(), 1))
        dead = client.engines[0]
        ray.kill(dead)

        async def cancel_during_the_restart():
            request = asyncio.ensure_future(client.generate([1, 10, 11], params))
            async with asyncio.timeout(60):
                while not (client.restarts == 1 and client.engines[0] is dead):
                    await asyncio.sleep(0.01)
            request.cancel()
            return await client.generate([1, 10, 11], params)

        out = asyncio.run(cancel_during_the_restart())
        assert client.restarts == 1 and client.engines[0] is not dead and out.weight_version == 1
    finally:
        client.shutdown()


def test_an_engine_that_cannot_start_stops_the_wait_naming_what_it_asked_and_what_is_free(
    ray_cluster, tiny_model_path
):
    """An engine asking for a GPU the cluster lacks would wait in Ray's queue forever."""
    from skyrl.train.inference import InferenceEngineClient, InferenceEngineConfig

    cfg = InferenceEngineConfig(backend="hf", device="cpu", start_timeout_s=3)
    with pytest.raises(TimeoutError, match=r"start_timeout_s=3 s; each asks for .*'num_gpus': 1.* free"):
        InferenceEngineClient.from_config(cfg, str(tiny_model_path), resources={"num_cpus": 1, "num_gpus": 1})
