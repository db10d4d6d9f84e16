"""Inference engines (vLLM, Hugging Face) as Ray actors, the routing client, weight sync and an OpenAI-compatible endpoint."""

from skyrl.train.inference.client import (
    EngineDeadError,
    InferenceEngineClient,
    create_engine,
    resolve_engine_config,
)
from skyrl.train.inference.config import validate_engine_config, validate_server_config
from skyrl.train.inference.engine import EngineHealth, GenerationOutput, InferenceEngine, SamplingParams
from skyrl.train.inference.weights import WeightUpdateError, validate_weight_update
from skyrl.train.schema import InferenceEngineConfig, OpenAIServerConfig

__all__ = [
    "EngineDeadError",
    "EngineHealth",
    "GenerationOutput",
    "InferenceEngine",
    "InferenceEngineClient",
    "InferenceEngineConfig",
    "OpenAIServerConfig",
    "SamplingParams",
    "WeightUpdateError",
    "create_engine",
    "resolve_engine_config",
    "validate_engine_config",
    "validate_server_config",
    "validate_weight_update",
]
