"""A worker's persistence: its checkpoint shards and the Hugging Face export of its model.

A checkpoint directory of one worker group holds the model's and optimizer's shards
(torch.distributed.checkpoint), each rank's schedule and random generators, and the
`CHECKPOINT_DONE` marker, written last: a directory without it is incomplete (a kill
mid-write) and never loaded. The run's layout of such directories (one per saved step,
with the driver's state beside them) is `skyrl.train.checkpoints`'. Every function here
is collective: each rank of the group calls it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from skyrl.train.workers import weight_export
from skyrl.train.workers.lora import is_adapter_name

if TYPE_CHECKING:
    from skyrl.train.workers.fsdp_worker import FSDPWorker

CHECKPOINT_DONE = "COMPLETE"


def is_complete(path: str | Path) -> bool:
    """Whether `path` is a checkpoint whose writing finished."""
    return (Path(path) / CHECKPOINT_DONE).exists()


def save_hf_model(worker: FSDPWorker, path: str) -> None:
    """`save_pretrained` of the full model and its tokenizer to `path`, from rank 0 (collective).

    With LoRA, `path` holds the adapter in peft's format (`PeftModel.from_pretrained` over the base
    model) and the tokenizer; with `trainer.export_merged` also the merged model in `path/merged`."""
    from transformers import AutoTokenizer

    if worker.lora is None:
        state = worker.full_state_dict()
        if worker.rank == 0:
            worker.model.save_pretrained(path, state_dict=state)
            AutoTokenizer.from_pretrained(worker.model_path).save_pretrained(path)
    else:
        from skyrl.train.inference.weights import save_peft_adapter

        adapters = worker.adapter_state_dict(scaled=False)
        trained = (
            n for n, p in worker.model.named_parameters() if p.requires_grad and not is_adapter_name(n)
        )
        full = weight_export.gathered(worker, trained)
        merged = worker.full_state_dict() if worker.cfg.export_merged else None
        if worker.rank == 0:
            save_peft_adapter(path, adapters, worker.lora.alpha, worker.model_path, full)
            AutoTokenizer.from_pretrained(worker.model_path).save_pretrained(path)
            if merged is not None:
                _save_merged(worker, str(Path(path) / "merged"), merged)
    dist.barrier()


def _save_merged(worker: FSDPWorker, path: str, state: dict[str, torch.Tensor]) -> None:
    """The merged model as a plain checkpoint of the base model's class (the LoRA layers are gone)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(worker.model.config)
    plain.save_pretrained(path, state_dict=state)
    AutoTokenizer.from_pretrained(worker.model_path).save_pretrained(path)


def save_checkpoint(worker: FSDPWorker, path: str) -> None:
    """Sharded model + optimizer (torch.distributed.checkpoint), schedule and RNG, atomically.

    Every rank writes into `path.tmp`; after a barrier rank 0 marks it complete
    and renames it to `path`, so a kill mid-write leaves no `path` at all.
    """
    final, tmp = Path(path), Path(f"{path}.tmp")
    state = _state_dict(worker)
    dcp.save(state, checkpoint_id=str(tmp))
    torch.save(_local_state(worker), tmp / f"local_rank{worker.rank}.pt")
    dist.barrier()
    if worker.rank == 0:
        (tmp / CHECKPOINT_DONE).touch()
        os.replace(tmp, final)
    dist.barrier()


def load_checkpoint(worker: FSDPWorker, path: str) -> None:
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {CHECKPOINT_DONE} marker)")
    local = torch.load(Path(path) / f"local_rank{worker.rank}.pt", weights_only=False)
    rank = worker.lora.rank if worker.lora else 0
    if local.get("lora_rank", 0) != rank:
        raise ValueError(
            f"{path} was saved with trainer.{worker.role}.lora.rank={local.get('lora_rank', 0)}, this run has "
            f"trainer.{worker.role}.lora.rank={rank}; resume with the checkpoint's setting"
        )
    state = _state_dict(worker)
    dcp.load(state, checkpoint_id=path)
    options = StateDictOptions(strict=worker.lora is None)  # LoRA: the adapters (and full heads) only
    if worker.optimizer is not None:
        set_state_dict(
            worker.model,
            worker.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )
    else:
        set_model_state_dict(worker.model, state["model"], options=options)
    worker.global_step = local["global_step"]
    if worker.scheduler is not None:
        worker.scheduler.load_state_dict(local["scheduler"])
    torch.set_rng_state(local["torch_rng"])
    random.setstate(local["python_rng"])
    np.random.set_state(local["numpy_rng"])
    if torch.cuda.is_available() and "cuda_rng" in local:
        torch.cuda.set_rng_state(local["cuda_rng"])


def _state_dict(worker: FSDPWorker) -> dict:
    """What a checkpoint holds of the model (with LoRA only what trains: the base is `model_path`)
    and of the optimizer."""
    if worker.optimizer is None:
        return {"model": get_model_state_dict(worker.model)}
    model_state, optim_state = get_state_dict(worker.model, worker.optimizer)
    if worker.lora is not None:
        trainable = {name for name, p in worker.model.named_parameters() if p.requires_grad}
        model_state = {name: t for name, t in model_state.items() if name in trainable}
    return {"model": model_state, "optimizer": optim_state}


def _local_state(worker: FSDPWorker) -> dict:
    state = {
        "global_step": worker.global_step,
        "lora_rank": worker.lora.rank if worker.lora else 0,
        "base_model": worker.model_path,
        "scheduler": worker.scheduler.state_dict() if worker.scheduler else None,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state()
    return state
