"""Ulysses sequence parallelism: the ranks of a sequence-parallel (sp) group compute one micro-batch together.

Each rank holds a contiguous `1/sp` slice of the micro-batch's tokens (`shard_layout`: padded to a multiple
of sp, positions kept global). Every layer runs on the slice, except attention: an all-to-all turns the
slice of every head into every token of `1/sp` of the heads, attention runs over the whole sequence, and a
second all-to-all turns it back (`ulysses_attention`). The head (logprobs, entropy, values) runs only at
the needed positions of the rank's slice, and `TokenLayout.scatter` sums the ranks' outputs over the group,
so every rank of the group holds the whole micro-batch's outputs and computes the same loss; backward
takes each rank's own entries (no reduction), so each token's gradient is counted once over the group.

Pure torch (`torch.distributed`): no Ray.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from skyrl.train.workers.attention import varlen_attention

HF_NAMES = {
    "sdpa": "skyrl_ulysses_sdpa",
    "varlen": "skyrl_ulysses_varlen",
}  # inner attention -> registered name
_GROUP: dist.ProcessGroup | None = None  # the sp group attention exchanges heads over (`use_group`)


def use_group(group: dist.ProcessGroup) -> None:
    """The sp group of this process's ranks: `ulysses_attention` exchanges over it (one group per process)."""
    global _GROUP
    _GROUP = group


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of equal chunks along dim 0; its adjoint is the same exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Chunk j of `x` (dim 0) to rank j; chunk j of the result from rank j. Both contiguous."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the group (each rank holds its own entries, zeros elsewhere). Backward: the
    gradient as it is, since every rank computes the same loss from the sum."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`x` summed over `group`, differentiable as each rank's own share (see `_SumOverGroup`)."""
    return _SumOverGroup.apply(x, group)


def _heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, H, L/sp, D] (every head, this rank's tokens) -> [B, H/sp, L, D] (this rank's heads, every token)."""
    size = dist.get_world_size(group)
    b, h, length, d = x.shape
    chunks = x.reshape(b, size, h // size, length, d).transpose(
        0, 1
    )  # [sp, B, H/sp, L/sp, D]: chunk j to rank j
    received = _AllToAll.apply(chunks, group)  # chunk j: rank j's tokens of this rank's heads
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * length, d)


def _sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, L, H/sp, D] (this rank's heads, every token) -> [B, L/sp, H, D] (every head, this rank's tokens)."""
    size = dist.get_world_size(group)
    b, length, h, d = x.shape
    chunks = x.reshape(b, size, length // size, h, d).transpose(
        0, 1
    )  # [sp, B, L/sp, H/sp, D]: tokens of rank j
    received = _AllToAll.apply(chunks, group)  # chunk j: rank j's heads of this rank's tokens
    return received.permute(1, 2, 0, 3, 4).reshape(b, length // size, size * h, d)


def _sdpa(query, key, value, scaling, dropout, **kwargs) -> torch.Tensor:
    """Causal sdpa over the whole (trimmed, right-padded) rows: [B, H, L, D] -> [B, L, H, D]."""
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        dropout_p=dropout,
        is_causal=True,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2)


def _varlen(module, query, key, value, scaling, dropout, **kwargs) -> torch.Tensor:
    return varlen_attention(module, query, key, value, None, scaling=scaling, **kwargs)[0]


def ulysses_attention(
    inner: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The Hugging Face attention-function contract on this rank's slice of the tokens: `query` [B, Hq, L/sp, D],
    `key`/`value` [B, Hkv, L/sp, D] -> [B, L/sp, Hq, D]; `inner` (sdpa, or varlen over packed sequences whose
    `cu_seq_lens_q` count the whole padded row) computes attention over every token of Hq/sp heads. Key and
    value heads that sp does not divide are repeated to one per query head first."""
    if attention_mask is not None or kwargs.get("sliding_window") is not None:
        raise ValueError(
            "sequence parallelism computes causal attention over whole sequences: no attention mask, no sliding "
            f"window ({module.__class__.__name__})"
        )
    group = _GROUP
    size = dist.get_world_size(group)
    if query.shape[1] % size:
        raise ValueError(
            f"sequence parallelism splits attention heads across its ranks: the model's {query.shape[1]} "
            f"attention heads are not a multiple of sequence_parallel_size={size}"
        )
    if key.shape[1] % size:
        key, value = (t.repeat_interleave(query.shape[1] // t.shape[1], dim=1) for t in (key, value))
    query, key, value = (_heads_to_sequence(t, group) for t in (query, key, value))
    attend = _sdpa if inner == "sdpa" else functools.partial(_varlen, module)
    out = attend(query, key, value, scaling, dropout if module.training else 0.0, **kwargs)
    return _sequence_to_heads(out, group), None


@functools.cache
def register_ulysses(inner: str) -> str:
    """Make Ulysses over `inner` (sdpa or varlen) an attention implementation of Hugging Face models; its
    name. No attention mask is built for it: attention is causal within each (packed) sequence."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_NAMES[inner], functools.partial(ulysses_attention, inner))
    return HF_NAMES[inner]


def shard_layout(layout, rank: int, size: int, group: dist.ProcessGroup):
    """Rank `rank`'s slice of `layout` (a `TokenLayout`) for an sp group of `size`: its tokens padded to a
    multiple of `size` (pad tokens: id 0, a packed layout's as a sequence of their own), then the
    `rank`-th contiguous slice of every row, with global positions; its needed positions and targets are
    those in the slice, and its `scatter` sums the group's outputs."""
    batch, length = layout.input_ids.shape
    pad = -length % size
    input_ids = F.pad(layout.input_ids, (0, pad))
    position_ids = torch.cat(
        [layout.position_ids, torch.arange(pad, device=layout.position_ids.device).repeat(batch, 1)], 1
    )
    bounds = {}
    if layout.cu_seqlens is not None:
        cu_seqlens = layout.cu_seqlens
        if pad:
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens[-1:] + pad])
        bounds = {"cu_seqlens": cu_seqlens, "max_length": max(layout.max_length, pad)}
    chunk = (length + pad) // size
    start = rank * chunk
    row, column = layout.index // length, layout.index % length
    mine = (column >= start) & (column < start + chunk)
    return dataclasses.replace(
        layout,
        input_ids=input_ids[:, start : start + chunk],
        position_ids=position_ids[:, start : start + chunk],
        index=row[mine] * chunk + column[mine] - start,
        targets=layout.targets[mine],
        rows=layout.rows[mine],
        cols=layout.cols[mine],
        sp_group=group,
        **bounds,
    )
