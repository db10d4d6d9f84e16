"""Helpers for engine tests: an HF reference model and its logprobs under a sampling setting."""

from copy import deepcopy

import pytest
import torch

from skyrl.train.inference import InferenceEngineClient, InferenceEngineConfig

# Small vLLM KV cache: the tiny model needs little and every engine allocates it up front.
TEST_KV_CACHE_BYTES = 64 << 20


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
