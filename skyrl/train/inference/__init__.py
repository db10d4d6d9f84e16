"""Inference engines (vLLM, Hugging Face) as Ray actors, the routing client, weight sync and an OpenAI-compatible endpoint.

Exports load on first use, so the modules that need no Ray (`shared_weights`, `weights`) import
on a machine without it.
"""

import importlib
from typing import Any

from skyrl.train.schema import InferenceEngineConfig, OpenAIServerConfig

_EXPORTS = {
    "EngineDeadError": "client",
    "InferenceEngineClient": "client",
    "create_engine": "client",
    "resolve_engine_config": "client",
    "validate_engine_config": "config",
    "validate_server_config": "config",
    "EngineHealth": "engine",
    "GenerationOutput": "engine",
    "InferenceEngine": "engine",
    "SamplingParams": "engine",
    "WeightUpdateError": "weights",
    "validate_weight_update": "weights",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


__all__ = ["InferenceEngineConfig", "OpenAIServerConfig", *_EXPORTS]
