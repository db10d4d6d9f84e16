"""Weight updates are checked against the model before any engine touches them.

A wrong shape kills a vLLM engine, and a fused projection (q/k/v, gate/up) that
receives only some of its parts is silently corrupted, so every update is
validated first: names, shapes, floating dtypes, and fused groups complete.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

# Checkpoint weights that vLLM fuses into one parameter (qkv_proj, gate_up_proj).
FUSED_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# Tied in the checkpoint, but vLLM keeps a separate lm_head: an update of one alone leaves the other stale.
TIED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")

WeightSpec = dict[str, tuple[int, ...]]


class WeightUpdateError(ValueError):
    """A weight update that does not fit the engine's model; nothing was loaded."""


def weight_spec_from_model(model: torch.nn.Module) -> WeightSpec:
    """Checkpoint names and shapes of `model` (what its `state_dict` holds; tied weights under each name)."""
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def checkpoint_weight_spec(model_path: str) -> WeightSpec:
    """The weight spec of the model at `model_path`, built on the meta device (no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return weight_spec_from_model(model)


def _fused_siblings(name: str) -> list[str]:
    if name in TIED_NAMES:
        return list(TIED_NAMES)
    parts = name.split(".")
    for group in FUSED_GROUPS:
        for i, part in enumerate(parts):
            if part in group:
                return [".".join([*parts[:i], sibling, *parts[i + 1 :]]) for sibling in group]
    return []


def validate_weight_update(named_tensors: Mapping[str, torch.Tensor], spec: WeightSpec) -> None:
    """Raise `WeightUpdateError` listing every problem of an update against `spec`.

    Rules: at least one tensor; every name is in the model; every shape equals the
    model's; every dtype is floating point; a fused group (q/k/v, gate/up of one
    layer) and the tied embedding / lm_head pair are sent whole or not at all.
    """
    if not named_tensors:
        raise WeightUpdateError("the weight update is empty; send the policy's state dict (name -> tensor).")
    problems = []
    unknown = [n for n in named_tensors if n not in spec]
    if unknown:
        problems.append(f"unknown names {unknown[:5]} (the model has e.g. {list(spec)[:3]})")
    for name, tensor in named_tensors.items():
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name} is a {type(tensor).__name__}, not a torch.Tensor")
        elif name in spec and tuple(tensor.shape) != spec[name]:
            problems.append(f"{name} has shape {tuple(tensor.shape)}, the model's is {spec[name]}")
        elif not tensor.is_floating_point():
            problems.append(f"{name} has dtype {tensor.dtype}, not a floating-point dtype")
    missing = sorted(
        {s for n in named_tensors for s in _fused_siblings(n) if s in spec and s not in named_tensors}
    )
    if missing:
        problems.append(f"fused and tied weights must arrive together; missing {missing[:6]}")
    if problems:
        raise WeightUpdateError("rejected weight update, nothing was loaded: " + "; ".join(problems) + ".")


# Per group, per tensor in sending order: (name, dtype name, shape).
StreamSpec = list[list[tuple[str, str, tuple[int, ...]]]]


def stream_spec(groups: Iterable[Mapping[str, torch.Tensor]]) -> StreamSpec:
    """The spec of weight groups (tensors or meta tensors) in the order they will be sent."""
    return [
        [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in group.items()]
        for group in groups
    ]


def validate_stream_spec(spec: StreamSpec, model_spec: WeightSpec) -> None:
    """`WeightUpdateError` unless every group of `spec` is a valid update of the model (see `validate_weight_update`)."""
    for group in spec:
        validate_weight_update(
            {
                name: torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
                for name, dtype, shape in group
            },
            model_spec,
        )
