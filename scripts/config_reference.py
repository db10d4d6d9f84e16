"""Write docs/reference/config.md: every configuration key with its type, default, allowed values and
description, from the schema (`skyrl/train/schema.py`, each field's docstring) and the values the
checks accept (the same constants and registries `skyrl.train.config` validates against).

Usage: python scripts/config_reference.py [--check]  (--check: exit 1 when the committed file is stale)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import MISSING, Field, fields, is_dataclass
from pathlib import Path
from typing import Any

from skyrl.envs.registry import registered_names, resolve
from skyrl.train.algorithms.advantages import ADVANTAGE_ESTIMATORS
from skyrl.train.algorithms.losses import KL_ESTIMATORS, OFF_POLICY_CORRECTIONS, POLICY_LOSSES
from skyrl.train.algorithms.reductions import REDUCTIONS
from skyrl.train.inference import config as engine_config
from skyrl.train.schema import (
    ATTN_IMPLEMENTATIONS,
    ENV_EXECUTORS,
    ENV_FAILURE_MODES,
    LORA_SYNCS,
    REWARD_TYPES,
    AlgorithmConfig,
    EnvironmentConfig,
    GeneratorConfig,
    InferenceEngineConfig,
    ModelConfig,
    RewardConfig,
    RewardSourceConfig,
    SkyRLConfig,
    TrainerConfig,
    field_docs,
)
from skyrl.train.utils import tracking

OUTPUT = Path(__file__).resolve().parents[1] / "docs" / "reference" / "config.md"
REGISTERED = "; or `package.module:name`"


def built_in(names: list[str], lookup: Callable[[str], Any]) -> list[str]:
    """The registered `names` whose function or class ships with skyrl (users and tests register more)."""
    return [name for name in names if lookup(name).__module__.startswith("skyrl.")]


# (section class, field) -> the values the config checks accept, and what else they accept
CHOICES: dict[tuple[type, str], Callable[[], tuple[list[str], str]]] = {
    (ModelConfig, "attn_implementation"): lambda: (list(ATTN_IMPLEMENTATIONS), ""),
    (AlgorithmConfig, "advantage_estimator"): lambda: (
        built_in(ADVANTAGE_ESTIMATORS.names(), ADVANTAGE_ESTIMATORS.get),
        REGISTERED,
    ),
    (AlgorithmConfig, "policy_loss"): lambda: (
        built_in(POLICY_LOSSES.names(), POLICY_LOSSES.get),
        REGISTERED,
    ),
    (AlgorithmConfig, "loss_reduction"): lambda: (list(REDUCTIONS), ""),
    (AlgorithmConfig, "kl_estimator"): lambda: (list(KL_ESTIMATORS), ""),
    (AlgorithmConfig, "off_policy_correction"): lambda: (list(OFF_POLICY_CORRECTIONS), ""),
    (TrainerConfig, "logger"): lambda: (list(tracking.BACKENDS), " (a list of them)"),
    (InferenceEngineConfig, "backend"): lambda: (list(engine_config.BACKENDS), ""),
    (InferenceEngineConfig, "device"): lambda: (list(engine_config.DEVICES), ""),
    (InferenceEngineConfig, "dtype"): lambda: (list(engine_config.DTYPES), ""),
    (InferenceEngineConfig, "weight_sync"): lambda: (list(engine_config.WEIGHT_SYNCS), ""),
    (InferenceEngineConfig, "lora_sync"): lambda: (list(LORA_SYNCS), ""),
    (GeneratorConfig, "env_executor"): lambda: (list(ENV_EXECUTORS), ""),
    (GeneratorConfig, "env_failure"): lambda: (list(ENV_FAILURE_MODES), ""),
    (EnvironmentConfig, "env_class"): lambda: (
        built_in(registered_names(), resolve),
        "; or `package.module:ClassName`",
    ),
    (RewardSourceConfig, "type"): lambda: (list(REWARD_TYPES), ""),
}
# mapping-valued fields whose entries are sections of their own: reward.sources.<name>
ENTRIES = {(RewardConfig, "sources"): ("<name>", RewardSourceConfig)}


def default(f: Field) -> Any:
    return f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]


def show(value: Any) -> str:
    """A default as one writes it in YAML or on the command line."""
    return value if isinstance(value, str) else json.dumps(value).replace('"', "")


def sections(cls: type, prefix: str) -> Iterator[tuple[str, type]]:
    """Each section (a dataclass) of the tree under `prefix`, depth first, with its key."""
    yield prefix, cls
    for f in fields(cls):
        own = default(f)
        if is_dataclass(own):
            yield from sections(type(own), f"{prefix}.{f.name}")
        elif (cls, f.name) in ENTRIES:
            name, entry = ENTRIES[cls, f.name]
            yield from sections(entry, f"{prefix}.{f.name}.{name}")


def cell(text: str) -> str:
    """`text` on one line of a table cell (a | would end the cell: GitHub and mkdocs escape it unalike)."""
    assert "|" not in text, f"a | in a table cell: {text!r}"
    return " ".join(text.split())


def type_name(annotation: str) -> str:
    return " or ".join("null" if part == "None" else part for part in annotation.split(" | "))


def render() -> str:
    lines = [
        "# Configuration keys",
        "",
        "Every key of the config tree, by section: its type, default, the values the checks accept and",
        "what it does. Set any of them on the command line (`python -m skyrl.train trainer.seed=1`) or in a",
        "recipe (`configs/`); see [Configuration](../configuration.md).",
        "",
        "Generated from `skyrl/train/schema.py` by `python scripts/config_reference.py`; edit the schema,",
        "not this file (a test fails when it is stale).",
    ]
    for key, cls in sections(SkyRLConfig, ""):
        if not key:
            continue
        docs = field_docs(cls)
        leaves = [f for f in fields(cls) if not is_dataclass(default(f))]
        if not leaves:
            continue
        lines += [
            "",
            f"## `{key[1:]}`",
            "",
            cell(cls.__doc__ or ""),
            "",
            "| key | type | default | description |",
        ]
        lines.append("| --- | --- | --- | --- |")
        for f in leaves:
            description = docs.get(f.name)
            assert description, f"{key[1:]}.{f.name} has no description: a docstring under it in the schema"
            if (cls, f.name) in CHOICES:
                values, more = CHOICES[cls, f.name]()
                description += f" Allowed: {', '.join(f'`{v}`' for v in values)}{more}."
            row = [f"`{key[1:]}.{f.name}`", type_name(f.type), f"`{show(default(f))}`", description]
            lines.append("| " + " | ".join(cell(text) for text in row) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed file is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            sys.exit(f"{OUTPUT} is stale: run python scripts/config_reference.py")
        return
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
