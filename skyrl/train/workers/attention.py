"""`attn_implementation=varlen`: packed sequences through torch's own variable-length flash attention.

A packed `TokenLayout` is one row of several sequences with no pad token between them; its
`cu_seqlens` (cumulative lengths, built on the host with the layout) tell each sequence apart.
On a GPU in bf16/fp16 this runs `torch.nn.attention.varlen.varlen_attn` (flash kernels shipped
with torch: no flash-attn package); otherwise (the CPU, fp32) causal sdpa per sequence (same
numbers, no packing gain), so the layout and its equivalence tests run everywhere. Hugging Face models call it
through their `AttentionInterface` under the name `HF_NAME`; no attention mask is built for it.
"""

from __future__ import annotations

import functools
import inspect
import itertools

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

HF_NAME = "skyrl_varlen"


# varlen_attn's causal argument: `window_size` from torch 2.11, `is_causal` in 2.10; `enable_gqa` (fewer key/value
# heads than query heads) where it takes it
_PARAMETERS = inspect.signature(varlen_attn).parameters
_CAUSAL = {"window_size": [-1, 0]} if "window_size" in _PARAMETERS else {"is_causal": True}
_GQA = "enable_gqa" in _PARAMETERS
if _GQA:
    _CAUSAL["enable_gqa"] = True


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence. `query` [1, Hq, T, D], `key`/`value` [1, Hkv, T, D];
    returns [1, T, Hq, D] (the Hugging Face attention-function contract)."""
    if query.shape[0] != 1 or cu_seq_lens_q is None or max_length_q is None or attention_mask is not None:
        raise ValueError(
            "attn_implementation=varlen computes packed layouts only (one row, cu_seq_lens_q and max_length_q "
            "given, no attention mask)"
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"attn_implementation=varlen has no sliding window ({module.__class__.__name__}); use sdpa"
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):  # flash kernels
        if not _GQA and k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        q, k, v = (
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
        )  # no copy when the projections laid them out so
        cu = cu_seq_lens_q.to(torch.int32)
        out = varlen_attn(q, k, v, cu, cu, max_length_q, max_length_q, scale=scaling, **_CAUSAL)
    else:
        bounds = cu_seq_lens_q.tolist()
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    *(t[start:end].transpose(0, 1) for t in (q, k, v)),
                    is_causal=True,
                    scale=scaling,
                    enable_gqa=k.shape[1] != q.shape[1],
                ).transpose(0, 1)
                for start, end in itertools.pairwise(bounds)
            ]
        )
    return out[None], None


@functools.cache
def register_varlen() -> None:
    """Make `HF_NAME` an attention implementation Hugging Face models can be loaded with."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_NAME, varlen_attention)
