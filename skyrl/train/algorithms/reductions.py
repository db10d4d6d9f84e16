"""Loss reductions that stay exact under micro-batching and data parallelism.

Gradient accumulation over micro-batches and the gradient all-reduce over DP
ranks both SUM. So nothing is averaged inside a micro-batch: once per
mini-batch, after padding it to a multiple of the DP size and before splitting
it, the trainer computes

    scale = loss_scale_for_reduction(loss_mask, reduction, max_seq_len)

a per-token weight that travels with the batch through every split. Each
micro-batch on each rank backpropagates the plain sum
`(per_token_loss * scale).sum()`; summed over all micro-batches and ranks this
is exactly `reduce_loss(per_token_loss, loss_mask, reduction)` of the whole
mini-batch, for any split. Pad rows have `loss_mask` 0, hence scale 0, and are
left out of every count. The DP all-reduce must therefore sum gradients (an
averaging all-reduce needs the loss multiplied by the DP size).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, TypeVar

import torch

REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over the entries where the 0/1 `mask` is 1 (along `dim`, or all); 0 where none is."""
    mask = mask.to(x.dtype)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def _check_reduction(reduction: str, max_seq_len: int | None) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown loss reduction {reduction!r}; choose one of {list(REDUCTIONS)}")
    if reduction == "seq_mean_token_sum_norm" and (max_seq_len is None or max_seq_len <= 0):
        raise ValueError(
            f"loss reduction 'seq_mean_token_sum_norm' needs a positive max_seq_len, got {max_seq_len}; "
            f"pass the maximum response length"
        )


def reduce_loss(
    per_token_loss: torch.Tensor, loss_mask: torch.Tensor, reduction: str, max_seq_len: int | None = None
) -> torch.Tensor:
    """A reduction by its definition, over one whole [N, R] batch.

    token_mean: mean over all masked tokens. sequence_mean: mean over sequences
    of each sequence's masked token mean. seq_mean_token_sum_norm (Dr. GRPO,
    Liu et al. 2025): mean over sequences of each sequence's masked token sum
    divided by the constant `max_seq_len`. Sequences are the rows with at least
    one masked-in token. An all-zero mask gives 0.
    """
    _check_reduction(reduction, max_seq_len)
    mask = loss_mask.to(per_token_loss.dtype)
    if reduction == "token_mean":
        return masked_mean(per_token_loss, mask)
    if reduction == "sequence_mean":
        per_sequence = masked_mean(per_token_loss, mask, dim=-1)
    else:
        per_sequence = (per_token_loss * mask).sum(-1) / max_seq_len
    return masked_mean(per_sequence, mask.sum(-1) > 0)


def reduction_counts(loss_mask: torch.Tensor) -> torch.Tensor:
    """[masked tokens, sequences with any masked token] of `loss_mask`, as a float64 tensor.

    Counts add up over any split of the rows, so a DP rank holding only its share
    gets the whole mini-batch's counts by summing this over ranks (all-reduce).
    """
    mask = loss_mask.to(torch.float64)
    return torch.stack([mask.sum(), (mask.sum(-1) > 0).sum().to(torch.float64)])


def loss_scale_for_reduction(
    loss_mask: torch.Tensor,
    reduction: str,
    max_seq_len: int | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token weights [N, R] such that `(per_token_loss * scale).sum() == reduce_loss(...)`.

    Compute it on the whole (padded) mini-batch, or on one rank's share with
    `counts` = the sum of `reduction_counts` over all shares; any split of the
    rows then sums to the same loss and gradient (see the module docstring).
    token_mean: mask / masked tokens; sequence_mean: mask / (sequences * the
    row's masked tokens); seq_mean_token_sum_norm: mask / (sequences * max_seq_len).
    """
    _check_reduction(reduction, max_seq_len)
    mask = loss_mask if loss_mask.is_floating_point() else loss_mask.float()
    num_tokens, num_sequences = (reduction_counts(mask) if counts is None else counts).clamp(min=1).tolist()
    if reduction == "token_mean":
        return mask / num_tokens
    if reduction == "sequence_mean":
        return mask / (num_sequences * mask.sum(-1, keepdim=True).clamp(min=1))
    return mask / (num_sequences * max_seq_len)


class Sliceable(Protocol):
    def __len__(self) -> int: ...

    def slice(self, start: int, end: int) -> Sliceable: ...


B = TypeVar("B", bound=Sliceable)


def num_micro_batches(num_sequences: int, micro_batch_size: int) -> int:
    """ceil(num_sequences / micro_batch_size); the last micro-batch may be smaller."""
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
    return -(-num_sequences // micro_batch_size)


def iter_micro_batches(batch: B, micro_batch_size: int) -> Iterator[B]:
    """Consecutive `batch.slice(start, end)` of `micro_batch_size` rows, the last one ragged."""
    n = len(batch)
    count = num_micro_batches(n, micro_batch_size)
    return (batch.slice(i * micro_batch_size, min((i + 1) * micro_batch_size, n)) for i in range(count))
