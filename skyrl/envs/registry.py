"""Environment registry: built-in names, `register(name, entry_point)`, and `package.module:Class`."""

from __future__ import annotations

import importlib
from typing import Any

from skyrl.envs.base import BaseTextEnv

_REGISTRY: dict[str, str | type[BaseTextEnv]] = {
    "guess_number": "skyrl.envs.guess_number:GuessNumberEnv",
    "math": "skyrl.envs.math_env:MathEnv",
    "calculator": "skyrl.envs.calculator:CalculatorEnv",
    "chat": "skyrl.envs.chat:ChatEnv",
}


def register(name: str, entry_point: str | type[BaseTextEnv]) -> None:
    """Make `name` build `entry_point` (a `BaseTextEnv` subclass, or `"package.module:Class"`)."""
    _REGISTRY[name] = entry_point


def registered_names() -> list[str]:
    return sorted(_REGISTRY)


def _import(entry_point: str, name: str) -> Any:
    module_name, _, attr = entry_point.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"environment {name!r}: cannot import module {module_name!r} ({e})") from e
    if not hasattr(module, attr):
        raise ValueError(f"environment {name!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def resolve(name: str) -> type[BaseTextEnv]:
    """The env class for a registered name or `"package.module:Class"`; `ValueError` naming the options."""
    entry_point = _REGISTRY.get(name, name if ":" in name else None)
    if entry_point is None:
        raise ValueError(
            f"unknown environment {name!r}; registered: {registered_names()}, "
            "or give your own as 'package.module:ClassName'"
        )
    cls = _import(entry_point, name) if isinstance(entry_point, str) else entry_point
    if not (isinstance(cls, type) and issubclass(cls, BaseTextEnv)):
        raise ValueError(
            f"environment {name!r} resolves to {cls!r}, which is not a skyrl.envs.BaseTextEnv subclass; "
            f"registered environments: {registered_names()}"
        )
    return cls


def make(
    name: str, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None
) -> BaseTextEnv:
    """A new environment instance for one episode."""
    return resolve(name)(env_config, extras)
