"""Command-line overrides checked against the config schema before Hydra composes them.

Hydra reports an unknown key or a wrong type deep in its own traceback; this turns
each into one line naming the key, the value and a valid alternative.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from skyrl.train.schema import SkyRLConfig, field_docs
from skyrl.train.utils.errors import ConfigError


def _all_keys(cls: Any, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        inner = _dataclass_of(cls, f.name)
        if inner is not None:
            keys += _all_keys(inner, f"{key}.")
    return keys


def _dataclass_of(cls: Any, name: str) -> Any:
    hint = typing.get_type_hints(cls)[name]
    for candidate in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _is_dict(cls: Any, name: str) -> bool:
    hint = typing.get_type_hints(cls)[name]
    return hint is dict or typing.get_origin(hint) is dict


def describe(key: str) -> str:
    """What schema key `key` (e.g. `trainer.policy.optimizer.lr`) sets: the first sentence of its field's
    description in `skyrl/train/schema.py`."""
    cls, *sections, name = [SkyRLConfig, *key.split(".")]
    for part in sections:
        cls = _dataclass_of(cls, part)
    return " ".join(field_docs(cls)[name].split()).split(". ")[0].rstrip(".")


def _check_key(key: str) -> None:
    cls, parts = SkyRLConfig, key.split(".")
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            parent = ".".join(parts[:i])
            full = [k for k in _all_keys(SkyRLConfig) if k.count(".") == key.count(".")]
            close = difflib.get_close_matches(key, full, n=1) or [
                f"{parent}.{m}" if parent else m for m in difflib.get_close_matches(part, names, n=1)
            ]
            hint = (
                f"; did you mean {close[0]} ({describe(close[0])})?"
                if close
                else f"; {parent or 'the top level'} has {names}"
            )
            raise ConfigError(
                f"unknown config key {key!r}{hint} (python -m skyrl.train --cfg job lists every key)"
            )
        if _is_dict(cls, part):
            return  # free-form below a dict, e.g. environment.config.<env>.<option>
        inner = _dataclass_of(cls, part)
        if inner is None:
            if i < len(parts) - 1:
                raise ConfigError(f"config key {key!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
            return
        cls = inner


@functools.cache
def _schema() -> Any:
    """The schema as an OmegaConf node, built once (merging into it leaves it unchanged)."""
    return OmegaConf.structured(SkyRLConfig)


def _check_value(key: str, value: str) -> None:
    base = _schema()
    try:
        OmegaConf.merge(base, OmegaConf.from_dotlist([f"{key}={value}"]))
    except OmegaConfBaseException as e:
        default = OmegaConf.select(base, key)
        example = f"e.g. {key}={default}" if default is not None else "see python -m skyrl.train --cfg job"
        reason = str(e).splitlines()[0]
        raise ConfigError(
            f"{key}={value!r} does not fit the schema ({reason}); {example} ({key}: {describe(key)})"
        ) from None


def check_overrides(args: list[str], config_dir: Path, *more_dirs: Path) -> None:
    """Raise `ConfigError` for the first `key=value` override that names no key, or a value of the
    wrong type, or a preset (`algorithm=...`) that does not exist in the groups of `config_dir` or
    `more_dirs` (a `--config-dir`). Hydra's own flags are skipped."""
    groups: dict[str, list[str]] = {}
    for d in (config_dir, *more_dirs):
        for p in d.iterdir():
            if p.is_dir():
                groups[p.name] = sorted({*groups.get(p.name, []), *(f.stem for f in p.glob("*.yaml"))})
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        if key in groups:
            if value not in groups[key]:
                raise ConfigError(
                    f"{key}={value!r} is not a preset; choose one of {groups[key]}, e.g. {key}={groups[key][0]}"
                )
            continue
        _check_key(key)
        _check_value(key, value)


def check_config_name(name: str, config_dir: Path | None, base_dir: Path) -> None:
    """Raise `ConfigError` unless `name` (`--config-name`) is a config in `base_dir` (the package's
    tree) or a recipe in `config_dir` (`--config-dir`, e.g. the repository's `configs/`)."""
    name = name.removesuffix(".yaml")
    if config_dir is not None and not config_dir.is_dir():
        raise ConfigError(
            f"--config-dir {str(config_dir)!r} is not a directory (relative paths start at {Path.cwd()}); "
            "run from the repository root, or give the path of its configs/ folder"
        )
    if any((d / f"{name}.yaml").is_file() for d in (base_dir, config_dir) if d is not None):
        return
    if config_dir is None:
        raise ConfigError(
            f"--config-name {name!r} is not a config of the package; recipes are in the repository's "
            "configs/ folder: add --config-dir configs (from the repository root)"
        )
    recipes = sorted(p.stem for p in config_dir.glob("*.yaml"))
    close = difflib.get_close_matches(name, recipes, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(f"--config-name {name!r} is not a recipe in {config_dir}; {hint}recipes: {recipes}")
