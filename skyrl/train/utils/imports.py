"""User code named in the config as `package.module:name`."""

from __future__ import annotations

import importlib
from typing import Any

from skyrl.train.utils.errors import ConfigError


def load_entry_point(spec: str, key: str) -> Any:
    """The object `spec` (`package.module:name`) names; `ConfigError` naming `key` and what failed."""
    module_name, colon, attr = spec.partition(":")
    if not (colon and module_name and attr):
        raise ConfigError(f"{key}={spec!r} must be 'package.module:name', e.g. 'my_agent:run'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"{key}={spec!r}: cannot import module {module_name!r} ({e}); it must be importable from the "
            "directory the run starts in or the Python path"
        ) from None
    if not hasattr(module, attr):
        raise ConfigError(f"{key}={spec!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)
