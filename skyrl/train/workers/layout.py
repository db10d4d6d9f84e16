"""How a rank's rows are computed: prefix-shared units, token-budget micro-batches, pad-free tokens.

The rows (one per step-wise sequence, `dataset.preprocess`'s layout) define WHAT is
computed; this module only decides HOW. Rows that share a `prefix_group` are steps of
one trajectory whose sequences are token-exact prefixes of each other, so one forward
of the longest gives every step's response logprobs (same tokens before them, same
positions). Such a group is a unit: it is never split across micro-batches. A
micro-batch's units are laid out without pad tokens between them (`packed`: one row,
positions restarting per unit, for attention kernels that take packed sequences) or
right-padded to its own longest unit only (`trimmed`: causal attention never looks
at the padding after a sequence). Per-token outputs come back to the rows' [n, R]
layout with `TokenLayout.scatter`, so losses and reductions see the plain rows.

Pure torch: no Ray, no model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from skyrl.train.training_batch import longest_rows, row_groups
from skyrl.train.utils.seqlen_balancing import get_seqlen_balanced_partitions
from skyrl.train.workers.sequence_parallel import sum_over_group


def unit_tokens(
    attention_mask: torch.Tensor, response_mask: torch.Tensor, units: list[list[int]]
) -> list[int]:
    """Tokens one forward of each unit computes: its longest row's, or 0 when no row of it has a
    response token to score (a pad row: nothing to compute)."""
    lengths = attention_mask.sum(-1).tolist()
    needed = response_mask.sum(-1).tolist()
    longest = longest_rows(attention_mask, units)
    return [lengths[i] if any(needed[j] for j in unit) else 0 for i, unit in zip(longest, units, strict=True)]


def plan_micro_batches(
    tokens: list[int],
    rows: list[int],
    micro_batch_size: int,
    max_tokens: int | None,
    count: int | None = None,
    cost: Callable[[float], float] | None = None,
) -> list[list[int]]:
    """Units (indices into `tokens` / `rows`, their token and row counts) per micro-batch.

    `max_tokens` None: consecutive units up to `micro_batch_size` rows each (a larger unit alone).
    Otherwise at most `max_tokens` tokens each (a larger unit alone), balanced by workload
    (`cost(tokens)`, e.g. `attention_aware_cost`; tokens when None) over the fewest micro-batches
    that fit. `count` asks for exactly that many (at least the fewest): every
    rank must run the same number of forwards, so ranks with fewer units get rebalanced or empty ones.
    """
    if max_tokens is None:
        plan: list[list[int]] = []
        size = micro_batch_size
        for u, n in enumerate(rows):
            if not plan or size + n > micro_batch_size:
                plan.append([])
                size = 0
            plan[-1].append(u)
            size += n
    else:
        plan = _token_plan(tokens, max_tokens, count, cost)
    if count is not None:
        assert count >= len(plan), f"asked for {count} micro-batches but {len(plan)} are needed"
        plan += [[] for _ in range(count - len(plan))]
    return plan


def _token_plan(
    tokens: list[int], max_tokens: int, count: int | None, cost: Callable[[float], float] | None
) -> list[list[int]]:
    def fits(parts: list[list[int]]) -> bool:
        return all(len(p) <= 1 or sum(tokens[u] for u in p) <= max_tokens for p in parts)

    if count is not None:
        parts = get_seqlen_balanced_partitions(tokens, count, equal_size=False, cost=cost)
        if fits(parts):
            return parts
    k = max(1, -(-sum(tokens) // max_tokens))
    while True:
        parts = get_seqlen_balanced_partitions(tokens, k, equal_size=False, cost=cost)
        if fits(parts):
            return [p for p in parts if p]
        k += 1


@dataclasses.dataclass
class TokenLayout:
    """One micro-batch as the model computes it.

    `input_ids` / `position_ids` [B, L]; `index` [K]: flat positions (b * L + t) of the
    hidden states that predict the K needed tokens (every row's real response tokens),
    `targets` [K] those tokens, `rows` / `cols` [K] where each sits in the rows' [n, R]
    layout. Packed layouts have B = 1 and positions restarting at each unit; their `cu_seqlens`
    [units + 1] (int32) are the units' boundaries and `max_length` the longest unit's tokens (None
    when not packed), what variable-length attention kernels take. A sequence-parallel slice holds its
    rank's tokens and needed positions only, and its `scatter` sums the slices of its `sp_group`.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    index: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    num_rows: int
    width: int
    cu_seqlens: torch.Tensor | None = None
    max_length: int | None = None
    sp_group: Any = None  # a sequence-parallel slice's group (`sequence_parallel.shard_layout`), else None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Per-needed-token `values` [K] (or [K, C]) into the rows' [n, R] (or [n, R, C]) layout, 0 elsewhere
        (differentiable)."""
        out = values.new_zeros(self.num_rows, self.width, *values.shape[1:])
        out = out.index_put((self.rows, self.cols), values)
        return out if self.sp_group is None else sum_over_group(out, self.sp_group)

    def attention_kwargs(self) -> dict:
        """What a Hugging Face model's forward passes down to its attention function for this layout."""
        if self.cu_seqlens is None:
            return {}
        bounds = {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens}
        return {**bounds, "max_length_q": self.max_length, "max_length_k": self.max_length}

    def to(self, device: torch.device) -> TokenLayout:
        tensors = ("input_ids", "position_ids", "index", "targets", "rows", "cols", "cu_seqlens")
        moved = {k: getattr(self, k).to(device) for k in tensors if getattr(self, k) is not None}
        return dataclasses.replace(self, **moved)


def build_layout(
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    prefix_group: torch.Tensor | None,
    packed: bool,
) -> TokenLayout:
    """The `TokenLayout` of a micro-batch of rows in `collate_sequences`' layout (left-padded prompt,
    right-padded response). Rows of one `prefix_group` must be prefixes of the group's longest row.
    Built with tensor ops over all rows (a loop per row cost ~19 us a row); only the other rows of a
    prefix group are compared with its longest one by one."""
    sequences, attention_mask, response_mask = sequences.cpu(), attention_mask.cpu(), response_mask.cpu()
    n, width = response_mask.shape
    prompt_width = sequences.shape[1] - width
    units = row_groups(prefix_group, n)
    needed = unit_tokens(attention_mask, response_mask, units)
    kept = [
        (unit, longest, size)
        for unit, longest, size in zip(units, longest_rows(attention_mask, units), needed, strict=True)
        if size
    ]
    lengths = [size for _, _, size in kept] or [1]
    batch, length = (1, sum(lengths)) if packed else (len(lengths), max(lengths))
    # each computed unit (its longest row's real tokens, contiguous): its first token among all units'
    # tokens, and where it starts in the flat [batch * length] layout
    sizes = torch.tensor([size for _, _, size in kept], dtype=torch.long)
    offsets = sizes.cumsum(0) - sizes
    starts = offsets if packed else torch.arange(len(kept)) * length
    computed = [longest for _, longest, _ in kept]
    tokens = sequences[computed][attention_mask[computed].bool()]
    within = torch.arange(len(tokens)) - offsets.repeat_interleave(sizes)
    input_ids = torch.zeros(batch, length, dtype=torch.long)
    input_ids.view(-1)[starts.repeat_interleave(sizes) + within] = tokens
    position_ids = torch.arange(length).repeat(batch, 1)
    if packed:
        position_ids[0, : len(tokens)] = within
    prompt_lengths = attention_mask[:, :prompt_width].sum(-1)
    response_lengths = response_mask.sum(-1)
    scored_rows = response_lengths.tolist()
    row_start = [0] * n  # the start of each row's unit
    for (unit, longest, _), start in zip(kept, starts.tolist(), strict=True):
        for i in unit:
            row_start[i] = start
        if len(unit) > 1:  # the group's other rows must be prefixes of its longest one
            whole = sequences[longest][attention_mask[longest].bool()]
            for i in unit:
                if i != longest and scored_rows[i]:
                    real = sequences[i][attention_mask[i].bool()]
                    assert torch.equal(real, whole[: len(real)]), "rows of a prefix group must be prefixes"
    scored = response_lengths > 0
    assert bool((prompt_lengths[scored] >= 1).all()), (
        "a row with response tokens needs at least one context token"
    )
    assert bool((attention_mask.sum(-1)[scored] <= (prompt_lengths + response_lengths)[scored]).all()), (
        "a row's attended tokens must end with its response tokens"
    )
    # every row's real response tokens (the first of its response part), row by row
    cols = torch.arange(width).expand(n, width)
    wanted = cols < response_lengths[:, None]
    rows = torch.arange(n)[:, None].expand(n, width)[wanted]
    cols = cols[wanted]
    index = torch.tensor(row_start, dtype=torch.long)[rows] + prompt_lengths[rows] - 1 + cols
    targets = sequences[:, prompt_width:][wanted]
    bounds = {}
    if packed:
        cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        bounds = {"cu_seqlens": cu_seqlens, "max_length": max(lengths)}
    return TokenLayout(input_ids, position_ids, index, targets, rows, cols, n, width, **bounds)
