"""Balanced assignment of sequences to data-parallel ranks.

Karmarkar-Karp largest differencing method, k-way (Karmarkar & Karp, 1982;
k-way form as in Korf, "Multi-way number partitioning", 2009): keep a heap of
partial solutions, each k subsets sorted by load; repeatedly merge the two
solutions with the largest spread (max - min load), pairing the heaviest subset
of one with the lightest of the other.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Sequence


def attention_aware_cost(linear_weight: float) -> Callable[[float], float]:
    """Workload `linear_weight * L + L**2`: MLP cost grows with L, attention with L^2."""
    return lambda length: linear_weight * length + length * length


def attention_cost_weight(hidden_size: int) -> float:
    """`attention_aware_cost`'s linear weight for a transformer of width `hidden_size`: per token and
    layer, projections and MLP take about 24 h^2 FLOPs and attention 4 h L, so the cost of a
    sequence of L tokens is proportional to 6 h L + L^2."""
    return 6.0 * hidden_size


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


def _best_exchange(heavy: list[int], light: list[int], costs: Sequence[float], gap: float, moves: bool):
    """The exchange between the heaviest partition and a lighter one (`gap` apart) that brings their
    loads closest together: swap an item of each (or, with `moves`, move one from heavy to light),
    shifting a load d with 0 < d < gap. Returns (d, item of heavy, item of light or -1 for a move),
    or None when no exchange does."""
    by_cost = sorted(light, key=lambda i: costs[i])
    light_costs = [costs[i] for i in by_cost]
    best = None
    for x in heavy:
        if moves and 0 < costs[x] < gap:
            best = min(best or (math.inf,), (abs(gap / 2 - costs[x]), costs[x], x, -1))
        # the light item whose swap shifts closest to gap / 2: cost near costs[x] - gap / 2
        j = bisect.bisect_left(light_costs, costs[x] - gap / 2)
        for k in (j - 1, j):
            if 0 <= k < len(by_cost):
                d = costs[x] - light_costs[k]
                if 0 < d < gap:
                    best = min(best or (math.inf,), (abs(gap / 2 - d), d, x, by_cost[k]))
    return None if best is None else best[1:]


def _refine(partitions: list[list[int]], costs: Sequence[float], equal_size: bool) -> list[list[int]]:
    """Lower the maximum load after KK: while some exchange between the heaviest partition and a
    lighter one brings the two closer (pairwise swaps, and single moves unless `equal_size`, which
    keeps the counts), apply the best one."""
    parts = [list(p) for p in partitions]
    loads = [sum(costs[i] for i in p) for p in parts]
    floor = max(sum(loads) / len(parts), max(costs, default=0.0))  # no partition can weigh less
    for _ in range(64 * len(parts)):
        h = max(range(len(parts)), key=loads.__getitem__)
        if loads[h] <= floor * (1 + 1e-9):
            break
        for light in sorted(range(len(parts)), key=loads.__getitem__):
            gap = loads[h] - loads[light]
            found = _best_exchange(parts[h], parts[light], costs, gap, not equal_size) if gap > 0 else None
            if found:
                break
        if not found:
            break
        d, x, y = found
        parts[h].remove(x)
        parts[light].append(x)
        if y >= 0:
            parts[light].remove(y)
            parts[h].append(y)
        loads[h] -= d
        loads[light] += d
    return parts


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
    count). KK's result is refined by swaps (and moves, without `equal_size`) between the heaviest
    partition and lighter ones while that lowers their spread. The result is never worse (max load) than strided assignment
    `range(i, n, k)`, which is returned when it happens to be better. Each
    partition's indices are sorted; partitions are ordered by smallest index.
    """
    if k <= 0:
        raise ValueError(f"number of partitions k must be positive, got {k}")
    if any(length < 0 for length in seqlens):
        raise ValueError("sequence lengths must be non-negative")
    costs = [float(cost(length)) if cost else float(length) for length in seqlens]
    partitions = _refine(_karmarkar_karp(costs, k, equal_size), costs, equal_size)
    strided = [list(range(i, len(costs), k)) for i in range(k)]
    if _max_load(strided, costs) < _max_load(partitions, costs):
        partitions = strided
    partitions = [sorted(part) for part in partitions]
    return sorted(partitions, key=lambda part: (not part, part[0] if part else 0))
