"""vLLM with tensor_parallel_size=2 (worker processes, the `mp` executor) on CPU: same contract, every weight
sync path, no orphans."""

import asyncio
import os

import psutil
import ray
import torch

from skyrl.train.inference import SamplingParams
from skyrl.train.inference.weights import stream_spec

from .conftest import (
    join_broadcast_sender,
    layer_groups,
    perturbed_copy,
    reference_logprobs,
    share_from_driver,
    start_client,
)


def is_vllm_worker(process: psutil.Process) -> bool:
    # vLLM retitles its workers "VLLM::Worker_TP<r>"; once in a full CI run they still read as the
    # spawned "python -c ...spawn_main(...)" they start as, so accept either
    return process.name().startswith("VLLM::Worker") or "spawn_main" in " ".join(process.cmdline())


def test_tensor_parallel_engine_serves_updated_weights_and_shutdown_reaps_its_workers(
    ray_cluster, tiny_model_path, reference_model
):
    client = start_client("vllm", tiny_model_path, tensor_parallel_size=2, num_cpus_per_engine=2)
    try:
        pid = ray.get(client.engines[0].__ray_call__.remote(lambda self: os.getpid()))
        children = psutil.Process(pid).children(recursive=True)
        workers = [p for p in children if is_vllm_worker(p)]
        assert len(workers) == 2, [p.cmdline() for p in children]
        perturbed = perturbed_copy(reference_model, seed=4)
        asyncio.run(client.update_weights(perturbed.state_dict(), 1))
        prompt = [1, 10, 11, 12]
        out = asyncio.run(client.generate(prompt, SamplingParams(temperature=0.8, max_tokens=8, seed=0)))
        expected = reference_logprobs(perturbed, prompt, out.response_ids, 0.8)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
        # broadcast: both tensor-parallel workers join the group and receive every layer
        sender = join_broadcast_sender(client)
        assert client.weight_sync_world_size == 3
        groups = layer_groups(perturbed_copy(reference_model, seed=5))
        asyncio.run(client.broadcast_weights(stream_spec(groups), 2, lambda: sender.send.remote(groups)))
        out = asyncio.run(client.generate(prompt, SamplingParams(temperature=0.8, max_tokens=8, seed=0)))
        expected = reference_logprobs(perturbed_copy(reference_model, seed=5), prompt, out.response_ids, 0.8)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
        # shared memory: both worker processes map each group and load their shards from it
        groups = layer_groups(perturbed_copy(reference_model, seed=6))
        asyncio.run(client.share_weights(stream_spec(groups), 3, share_from_driver(groups, 3)))
        out = asyncio.run(client.generate(prompt, SamplingParams(temperature=0.8, max_tokens=8, seed=0)))
        expected = reference_logprobs(perturbed_copy(reference_model, seed=6), prompt, out.response_ids, 0.8)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
    finally:
        client.shutdown()
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"vLLM workers outlived the engine: {alive}"
