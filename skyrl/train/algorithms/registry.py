"""Name -> function registries that users extend without touching the trainer."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
    """Built-ins registered by name; `"package.module:function"` names are imported on demand."""

    def __init__(self, kind: str):
        self.kind = kind
        self._functions: dict[str, Callable] = {}

    def names(self) -> list[str]:
        return sorted(self._functions)

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator adding a function under `name`; a name already taken raises `ValueError`."""

        def decorator(fn: F) -> F:
            if name in self._functions:
                raise ValueError(f"{self.kind} {name!r} is already registered; pick another name")
            self._functions[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> Callable:
        """The function registered as `name`, or imported from `"module:function"`.

        Raises `ValueError` naming the registered functions when neither works.
        """
        if name in self._functions:
            return self._functions[name]
        if ":" not in name:
            raise ValueError(
                f"unknown {self.kind} {name!r}; registered: {self.names()}, "
                f"or give your own as 'package.module:function'"
            )
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise ValueError(f"{self.kind} {name!r}: cannot import module {module_name!r} ({e})") from e
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ValueError(f"{self.kind} {name!r}: module {module_name!r} has no function {attr!r}")
        return fn
