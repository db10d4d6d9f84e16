"""LoRA on the FSDP workers: adapters injected with peft into the Hugging Face model, in place.

The model keeps its class and its parameter names, except that a targeted projection `p` becomes
`p.base_layer` (frozen) with `p.lora_A.default` / `p.lora_B.default` beside it. What leaves a worker
uses the checkpoint's names again: `merge_adapters` gives the merged weights (base + alpha / rank *
B @ A) under the base model's names, `adapter_tensors` the adapters as `p.lora_A.weight` /
`p.lora_B.weight` (see `skyrl.train.inference.weights`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch

from skyrl.train.schema import LoRAConfig

ADAPTER = "default"  # peft's name for the one adapter a worker trains


def target_module_names(model: torch.nn.Module) -> list[str]:
    """The names LoRA can target in `model`: the last component of every linear layer's name inside the
    decoder layers (q_proj, ..., down_proj for Llama / Qwen models)."""
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and ".layers." in name
        }
    )


def add_adapters(model: torch.nn.Module, cfg: LoRAConfig, key: str, full: Sequence[str] = ()) -> None:
    """Inject rank-`cfg.rank` adapters into `model`'s `cfg.target_modules` and freeze everything but
    them and the modules `cfg.modules_to_save` and `full` name (a module's name or its ending after a
    dot). `ValueError` naming `key` (the config section) when a name matches no module."""
    from peft import LoraConfig, inject_adapter_in_model

    valid = target_module_names(model)
    unknown = [t for t in cfg.target_modules if t not in valid]
    if unknown or not cfg.target_modules:
        raise ValueError(
            f"{key}.target_modules={list(cfg.target_modules)}: {unknown or 'empty'} "
            f"{'are' if len(unknown) > 1 else 'is'} not a linear layer of this model; choose from {valid}"
        )
    config = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
    )
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    modules = dict(model.named_modules())
    for wanted in [*cfg.modules_to_save, *full]:
        matches = [m for name, m in modules.items() if name == wanted or name.endswith(f".{wanted}")]
        if not matches:
            raise ValueError(
                f"{key}.modules_to_save={list(cfg.modules_to_save)}: {wanted!r} is not a module of this model; "
                f"e.g. {[n for n in modules if n and '.layers.' not in n][:6]}"
            )
        for module in matches:
            module.requires_grad_(True)


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merge_adapters(state: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The base model's weights, under its own names, from a state dict (or part of one, whole modules)
    with injected adapters: `p.base_layer.weight + scaling * p.lora_B.weight @ p.lora_A.weight` becomes
    `p.weight`, `p.base_layer.bias` becomes `p.bias`. Works on meta tensors (names and shapes only)."""
    merged = {}
    for name, tensor in state.items():
        if is_adapter_name(name):
            continue
        if ".base_layer." in name:
            module, leaf = name.split(".base_layer.")
            if leaf == "weight":
                a, b = (state[f"{module}.lora_{x}.{ADAPTER}.weight"] for x in "AB")
                tensor = tensor + scaling * (b.to(tensor.dtype) @ a.to(tensor.dtype))
            name = f"{module}.{leaf}"
        merged[name] = tensor
    return merged


def adapter_tensors(state: Mapping[str, torch.Tensor], scaling: float = 1.0) -> dict[str, torch.Tensor]:
    """The adapters of a state dict as `p.lora_A.weight` / `p.lora_B.weight` (peft's saved names without
    their `base_model.model.` prefix), B multiplied by `scaling`."""
    tensors = {}
    for name, tensor in state.items():
        if is_adapter_name(name):
            tensor = tensor * scaling if ".lora_B." in name else tensor
            tensors[name.replace(f".{ADAPTER}.", ".")] = tensor
    return tensors


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """`model` computes its base model's outputs inside the block (forward only).

    Sets peft's per-layer flag directly: peft's own `enable_adapters(False)` also clears the adapters'
    `requires_grad`, which FSDP2 reads once, when it first builds a parameter's unsharded copy."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False
