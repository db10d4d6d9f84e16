"""Weight updates are checked against the model before any engine touches them.

A wrong shape kills a vLLM engine, and a fused projection (q/k/v, gate/up) that
receives only some of its parts is silently corrupted, so every update is
validated first: names, shapes, floating dtypes, and fused groups complete.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

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


# ---------------------------------------------------------------------------
# LoRA adapters: `<module>.lora_A.weight` [rank, in] and `<module>.lora_B.weight` [out, rank] for a
# linear `<module>.weight` [out, in] of the model; B carries the scale (alpha / rank), so an engine
# computes W x + B A x.
# ---------------------------------------------------------------------------

ADAPTER_PARTS = (".lora_A.weight", ".lora_B.weight")


def lora_target_names(modules: Iterable[str]) -> list[str]:
    """peft's `target_modules` for adapters on `modules`: their last name components (q_proj, ...)."""
    return sorted({m.rsplit(".", 1)[-1] for m in modules})


def is_adapter_update(named_tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether an update carries LoRA adapters (every name ends in `ADAPTER_PARTS`) rather than weights."""
    return bool(named_tensors) and all(name.endswith(ADAPTER_PARTS) for name in named_tensors)


def adapter_modules(named_tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The module names an adapter update targets (`model.layers.0.self_attn.q_proj`, ...), sorted."""
    return sorted({name.rsplit(".", 2)[0] for name in named_tensors})


def validate_adapter_update(named_tensors: Mapping[str, torch.Tensor], spec: WeightSpec) -> int:
    """The adapters' rank; `WeightUpdateError` listing every problem: a name that is not an adapter part,
    a module the model lacks, an A without its B (or the reverse), shapes that do not fit the module's
    weight, ranks that differ, a non-floating dtype."""
    problems = [
        f"{n} is not a LoRA adapter part {ADAPTER_PARTS}"
        for n in named_tensors
        if not n.endswith(ADAPTER_PARTS)
    ]
    ranks = set()
    for module in adapter_modules(named_tensors):
        a, b = (named_tensors.get(module + part) for part in ADAPTER_PARTS)
        weight = spec.get(f"{module}.weight")
        if weight is None or len(weight) != 2:
            problems.append(f"{module} is not a linear layer of the model")
        elif a is None or b is None:
            problems.append(f"{module} needs both lora_A and lora_B")
        elif not (a.is_floating_point() and b.is_floating_point()):
            problems.append(f"{module}'s adapters have dtypes {a.dtype} / {b.dtype}, not floating point")
        elif (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != weight[1]
            or b.shape[0] != weight[0]
            or a.shape[0] != b.shape[1]
        ):
            problems.append(
                f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit its weight {weight} "
                "(need [rank, in] and [out, rank])"
            )
        else:
            ranks.add(a.shape[0])
    if len(ranks) > 1:
        problems.append(f"the adapters have different ranks {sorted(ranks)}")
    if not named_tensors:
        problems.append("the update is empty")
    if problems:
        raise WeightUpdateError("rejected adapter update, nothing was loaded: " + "; ".join(problems) + ".")
    return ranks.pop()


def save_peft_adapter(
    path: str | Path,
    named_tensors: Mapping[str, torch.Tensor],
    alpha: float,
    base_model: str | None = None,
    full: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Write an adapter update in peft's format (`adapter_config.json`, `adapter_model.safetensors`), which
    `PeftModel.from_pretrained` and vLLM's `LoRARequest` load; `full` holds the weights of modules trained
    in full (peft's `modules_to_save`), under the model's names."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    modules = adapter_modules(named_tensors)
    rank = named_tensors[modules[0] + ADAPTER_PARTS[0]].shape[0]
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=lora_target_names(modules),
        modules_to_save=sorted({n.rsplit(".", 1)[0] for n in full or {}}) or None,
        base_model_name_or_path=base_model,
    )
    Path(path).mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    named = {**named_tensors, **(full or {})}
    tensors = {f"base_model.model.{n}": t.detach().cpu().contiguous() for n, t in named.items()}
    save_file(tensors, str(Path(path) / "adapter_model.safetensors"))
