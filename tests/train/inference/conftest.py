"""Helpers for engine tests: an HF reference model and its logprobs under a sampling setting."""

import asyncio
import contextlib
from collections.abc import Iterator
from copy import deepcopy

import pytest
import ray
import torch

from skyrl.train.inference import InferenceEngineClient, InferenceEngineConfig
from skyrl.train.inference.shared_weights import packed_nbytes, send_shared
from skyrl.train.inference.weight_sync import WeightSyncGroup, init_sync_group, send_group
from skyrl.train.workers.actor_group import node_free_port

# Small vLLM KV cache: the tiny model needs little and every engine allocates it up front.
TEST_KV_CACHE_BYTES = 64 << 20


@contextlib.contextmanager
def serving(model_path, cfg) -> Iterator:
    """(loop, server): an `OpenAIServer` with `cfg` over one hf engine on `model_path`; the server and its
    client live on a `BackgroundLoop` of their own, as in a driver (`loop.run(coro)` runs on it)."""
    from skyrl.train.inference.openai_server import OpenAIServer
    from skyrl.train.utils.background_loop import BackgroundLoop

    client = start_client("hf", model_path)
    loop = BackgroundLoop()
    server = OpenAIServer(client, model_path, cfg)
    loop.run(server.start())
    try:
        yield loop, server
    finally:
        loop.run(server.stop())
        loop.close()
        client.shutdown()


def memorise(path, conversations) -> None:
    """Train the model at `path` until greedy decoding gives each (prompt ids, response ids) response
    with a margin: every response token at probability 0.9 or more. An argmax won by a hair (at
    lr 1e-2 the judge's "7" and "2" stalled at 0.5 each) flipped in an engine's batched forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(500):
        loss, learnt = 0.0, True
        for prompt, response in conversations:
            ids = torch.tensor([prompt + response])
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
            target = ids[0, len(prompt) :]
            loss = loss + torch.nn.functional.cross_entropy(logits, target)
            learnt &= bool((logits.softmax(-1).gather(1, target[:, None]) >= 0.9).all())
        if learnt:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert learnt, "the tiny model did not memorise the conversation"
    model.save_pretrained(path)


def answered(server, tokenizer, text: str, use) -> dict:
    """The chat choice `server` answers for an engine output whose tokens are `text`, with `use`
    (a `ToolUse` or None)."""
    from skyrl.train.inference.engine import GenerationOutput, SamplingParams
    from skyrl.train.inference.openai_format import chat_choice

    out = GenerationOutput(tokenizer.encode(text), None, "stop", 0)
    return chat_choice(tokenizer, 0, out, server._answer(out, SamplingParams(max_tokens=64), use))


def start_client(backend: str, model_path, **overrides) -> InferenceEngineClient:
    cfg = InferenceEngineConfig(
        backend=backend, device="cpu", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES, **overrides
    )
    return InferenceEngineClient.from_config(cfg, str(model_path))


@pytest.fixture(scope="session")
def reference_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@torch.no_grad()
def perturbed_copy(model, scale: float = 0.05, seed: int = 0):
    """A copy of `model` with every parameter moved by Gaussian noise (tied weights stay tied)."""
    gen = torch.Generator().manual_seed(seed)
    copy = deepcopy(model)
    for param in copy.parameters():
        param.add_(scale * torch.randn(param.shape, generator=gen))
    return copy


@torch.no_grad()
def reference_logprobs(
    model, prompt: list[int], response: list[int], temperature: float, top_k: int | None = None
) -> torch.Tensor:
    """Log-probabilities of `response` under an HF forward: logits / temperature, top-k renormalised, greedy = raw."""
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
        if top_k is not None:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


@ray.remote
class BroadcastSender:
    """Rank 0 of a weight-sync group, sending a model's weights one decoder layer at a time."""

    def join(self, group: WeightSyncGroup) -> None:
        self.group = init_sync_group(group, 0)

    def send(self, groups: list[dict[str, torch.Tensor]]) -> None:
        for group in groups:
            send_group(self.group, group.values())


def layer_groups(model) -> list[dict[str, torch.Tensor]]:
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in model.state_dict().items():
        parts = name.split(".")
        groups.setdefault(".".join(parts[:3]) if parts[1] == "layers" else "other", {})[name] = tensor
    return list(groups.values())


def join_broadcast_sender(client: InferenceEngineClient):
    """A `BroadcastSender` joined with every engine of `client` in a gloo weight-sync group."""
    sender = BroadcastSender.remote()
    addr, port = ray.get(sender.__ray_call__.remote(lambda _: node_free_port()))
    group = WeightSyncGroup(addr, port, client.weight_sync_world_size, "gloo", timeout_s=60)
    asyncio.run(client.init_weight_sync(group, lambda: sender.join.remote(group)))
    return sender


def share_from_driver(groups: list[dict[str, torch.Tensor]], version: int):
    """A `send` for `client.share_weights`: this process shares `groups` with the first engine."""
    nbytes = max(packed_nbytes(g.values()) for g in groups)

    def send(engines):
        return asyncio.to_thread(send_shared, engines[0], groups, nbytes, torch.device("cpu"), version)

    return send
