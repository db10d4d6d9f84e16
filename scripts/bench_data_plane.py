"""Data-plane timings, each next to a baseline measured in the same run.

1. Prompt-unit boundaries + per-mini-batch DP padding over 1,000,000 step-wise
   sequences, against bare torch slicing of the same tensors into the same number
   of equal slices plus a torch.cat of pad rows.
2. Karmarkar-Karp over 100,000 lengths into 8 and 64 parts, against strided
   assignment: max/mean load and time.
3. Our balancing against plain Karmarkar-Karp (verl's algorithm) on heavy-tailed
   lengths, 4-64 items per rank: max-load ratio (last line) and time ratio.

Usage: python scripts/bench_data_plane.py [--sequences N] [--lengths N]
"""

from __future__ import annotations

import argparse
import time

import torch

from skyrl.train.dataset.preprocess import compute_prompt_mini_batch_boundaries
from skyrl.train.training_batch import TrainingInputBatch, pad_training_input_batch
from skyrl.train.utils.seqlen_balancing import _karmarkar_karp, get_seqlen_balanced_partitions

DP_SIZE = 8
MINI_BATCHES = 100


def make_batch(num_sequences: int, gen: torch.Generator) -> tuple[TrainingInputBatch, int]:
    steps = torch.randint(1, 8, (num_sequences,), generator=gen)  # turns per prompt
    uids, prompt = [], 0
    for n in steps.tolist():
        uids += [f"p{prompt}"] * n
        prompt += 1
        if len(uids) >= num_sequences:
            break
    num_prompts = prompt - prompt % MINI_BATCHES  # whole mini-batches only
    uids = uids[: next(i for i, u in enumerate(uids) if u == f"p{num_prompts}")]
    n = len(uids)
    batch = TrainingInputBatch(
        {
            "sequences": torch.randint(0, 1000, (n, 32), generator=gen),
            "attention_mask": torch.ones(n, 32, dtype=torch.long),
            "loss_mask": torch.ones(n, 16),
            "rewards": torch.zeros(n, 16),
        }
    )
    batch.metadata.update(uids=uids, is_last_step=[True] * n)
    return batch, num_prompts


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def bench_boundaries_and_padding(num_sequences: int, gen: torch.Generator) -> None:
    batch, num_prompts = make_batch(num_sequences, gen)
    mini = num_prompts // MINI_BATCHES

    def ours():
        bounds = compute_prompt_mini_batch_boundaries(batch.metadata["uids"], mini, num_prompts, True, 1)
        for start, end in bounds:
            part = batch.slice(start, end)
            pad_training_input_batch(part, (-len(part)) % DP_SIZE)
        return bounds

    def bare_torch():
        tensors = {k: v for k, v in batch.items()}
        for i in range(MINI_BATCHES):
            size = len(batch) // MINI_BATCHES
            for v in tensors.values():
                part = v[i * size : (i + 1) * size]
                pad = (-len(part)) % DP_SIZE
                torch.cat([part, part[:1].expand(pad, *part.shape[1:])])

    bare_torch()  # warm-up
    bounds, t_ours = timed(ours)
    _, t_bare = timed(bare_torch)
    print(
        f"boundaries + DP padding: {len(batch):,} step-wise sequences, {num_prompts:,} prompts, "
        f"{len(bounds)} mini-batches, dp={DP_SIZE}: skyrl {t_ours:.3f} s, bare torch slicing {t_bare:.3f} s, "
        f"ratio {t_ours / t_bare:.2f}x"
    )


def load_ratio(partitions: list[list[int]], lengths: list[int]) -> float:
    loads = [sum(lengths[i] for i in p) for p in partitions]
    return max(loads) / (sum(loads) / len(loads))


def bench_balancing(num_lengths: int, gen: torch.Generator) -> None:
    # long-tailed like real responses: most short, a few near the context limit
    lengths = (
        (torch.distributions.Exponential(1 / 600).sample((num_lengths,)).clamp(16, 8192)).long().tolist()
    )
    for k in (8, 64):
        strided, t_strided = timed(lambda k=k: [list(range(i, num_lengths, k)) for i in range(k)])
        for equal_size in (True, False):
            kk, t_kk = timed(
                lambda k=k, e=equal_size: get_seqlen_balanced_partitions(lengths, k, equal_size=e)
            )
            print(
                f"balancing {num_lengths:,} lengths into {k} parts (equal_size={equal_size}): max/mean load "
                f"KK {load_ratio(kk, lengths):.5f} in {t_kk:.3f} s, "
                f"strided {load_ratio(strided, lengths):.5f} in {t_strided:.4f} s"
            )


def bench_refinement(trials: int, gen: torch.Generator) -> None:
    """Our balancing (KK, then swaps between the heaviest and lighter partitions) against plain KK,
    the algorithm verl ships, on heavy-tailed (lognormal) lengths with equal counts per rank."""
    ratios, times = [], [0.0, 0.0]
    for items_per_rank in (4, 8, 16, 32, 64):
        for _ in range(trials):
            lengths = torch.distributions.LogNormal(6.0, 1.0).sample((8 * items_per_rank,)).long().tolist()
            costs = [float(n) for n in lengths]
            plain, t_plain = timed(lambda c=costs: _karmarkar_karp(c, 8, True))
            ours, t_ours = timed(lambda n=lengths: get_seqlen_balanced_partitions(n, 8, equal_size=True))
            ratios.append(load_ratio(ours, lengths) / load_ratio(plain, lengths))
            times[0] += t_plain
            times[1] += t_ours
        print(
            f"lognormal lengths, 8 ranks x {items_per_rank} items, {trials} draws: max load ours / plain KK "
            f"{sum(ratios[-trials:]) / trials:.3f} (worst {max(ratios[-trials:]):.3f})"
        )
    print(f"time ours / plain KK {times[1] / times[0]:.2f}")
    print(f"max load ours / plain KK {sum(ratios) / len(ratios):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sequences", type=int, default=1_000_000)
    parser.add_argument("--lengths", type=int, default=100_000)
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    bench_boundaries_and_padding(args.sequences, gen)
    bench_balancing(args.lengths, gen)
    bench_refinement(args.trials, gen)


if __name__ == "__main__":
    main()
