"""Environments: the `BaseTextEnv` API, a registry, and built-in envs (guess_number, math, calculator)."""

from skyrl.envs.base import BaseTextEnv, BaseTextEnvStepOutput, Message
from skyrl.envs.registry import make, register, registered_names, resolve

__all__ = [
    "BaseTextEnv",
    "BaseTextEnvStepOutput",
    "Message",
    "make",
    "register",
    "registered_names",
    "resolve",
]
