"""Balanced assignment of sequences to data-parallel ranks.

Karmarkar-Karp largest differencing method, k-way (Karmarkar & Karp, 1982;
k-way form as in Korf, "Multi-way number partitioning", 2009): keep a heap of
partial solutions, each k subsets sorted by load; repeatedly merge the two
solutions with the largest spread (max - min load), pairing the heaviest subset
of one with the lightest of the other.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence


def attention_aware_cost(linear_weight: float) -> Callable[[float], float]:
    """Workload `linear_weight * L + L**2`: MLP cost grows with L, attention with L^2."""
    return lambda length: linear_weight * length + length * length


# A subset is a list [load, count, -smallest_index, items]: plain lists sort by load, then
# count, then smallest index, which keeps the split deterministic. A partial solution holds
# only its non-empty subsets, heaviest first; the missing ones are empty (load 0).
def _merge(a: list[list], b: list[list], k: int) -> list[list]:
    """Pair the heaviest subsets of `a` with the lightest of `b` (empties included); consumes both."""
    overlap = max(0, k - len(b))
    merged = a[:overlap] + b[: max(0, k - len(a))]  # subsets paired with an empty one
    for i in range(overlap, len(a)):
        x, y = a[i], b[k - 1 - i]
        if len(y[3]) > len(x[3]):
            x[3], y[3] = y[3], x[3]
        x[3].extend(y[3])
        x[0] += y[0]
        x[1] += y[1]
        x[2] = max(x[2], y[2])
        merged.append(x)
    merged.sort(reverse=True)
    return merged


def _spread(state: list[list], k: int) -> float:
    return state[0][0] - (state[-1][0] if len(state) == k else 0.0)


def _karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool) -> list[list[int]]:
    order = sorted(range(len(costs)), key=lambda i: (costs[i], i), reverse=True)
    if equal_size:
        # k items at a time, heaviest first, so the one short group holds the lightest items;
        # merging then gives every subset one item per group.
        groups = [order[i : i + k] for i in range(0, len(order), k)]
    else:
        groups = [[i] for i in order]
    heap = []
    for tie, group in enumerate(groups):
        state = sorted(([costs[i], 1, -i, [i]] for i in group), reverse=True)
        heapq.heappush(heap, (-_spread(state, k), tie, state))
    tie = len(groups)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        state = _merge(a, b, k)
        heapq.heappush(heap, (-_spread(state, k), tie, state))
        tie += 1
    subsets = [subset[3] for subset in heap[0][2]] if heap else []
    return subsets + [[] for _ in range(k - len(subsets))]


def _max_load(partitions: list[list[int]], costs: Sequence[float]) -> float:
    return max(sum(costs[i] for i in part) for part in partitions)


def get_seqlen_balanced_partitions(
    seqlens: Sequence[int],
    k: int,
    equal_size: bool,
    cost: Callable[[float], float] | None = None,
) -> list[list[int]]:
    """Split indices of `seqlens` into `k` partitions of near-equal total workload.

    Workload per sequence is its length, or `cost(length)` (see
    `attention_aware_cost`). Deterministic; every index appears exactly once;
    no partition is empty when `len(seqlens) >= k`; with `equal_size` the
    partition sizes differ by at most 1 (exactly equal when `k` divides the
    count). The result is never worse (max load) than strided assignment
    `range(i, n, k)`, which is returned when it happens to be better. Each
    partition's indices are sorted; partitions are ordered by smallest index.
    """
    if k <= 0:
        raise ValueError(f"number of partitions k must be positive, got {k}")
    if any(length < 0 for length in seqlens):
        raise ValueError("sequence lengths must be non-negative")
    costs = [float(cost(length)) if cost else float(length) for length in seqlens]
    partitions = _karmarkar_karp(costs, k, equal_size)
    strided = [list(range(i, len(costs), k)) for i in range(k)]
    if _max_load(strided, costs) < _max_load(partitions, costs):
        partitions = strided
    partitions = [sorted(part) for part in partitions]
    return sorted(partitions, key=lambda part: (not part, part[0] if part else 0))
