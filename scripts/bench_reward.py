"""Reward-model scoring through the run's path (a `type: model` reward source: rows built from episodes,
staged to a forward-only FSDP2 worker group, scores back) against a bare Hugging Face forward of the same
texts in one process (`AutoModelForSequenceClassification`, right-padded batches of the same size).

Both use the same model (a Qwen2-style sequence-classification model built locally), the same CPU threads
and the same texts (random token sequences of mixed lengths); each is timed over `--repeats` batches after
a warm-up. Prints the texts per second of each and `ratio skyrl/bare` (throughput; the goal is >= 0.9).

Usage: python scripts/bench_reward.py [--texts 256] [--min-len 64] [--max-len 512] [--hidden 256] ...
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time

import ray
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from skyrl.train.cluster import WorkerGroups
from skyrl.train.dataset.preprocess import Trajectory, Turn
from skyrl.train.generator.rollout import Episode
from skyrl.train.rewards import Rewards
from skyrl.train.schema import ModelConfig, PlacementConfig, RefConfig, RewardConfig, TrainerConfig
from skyrl.train.utils.tiny_model import create_tiny_model
from skyrl.train.workers.actor_group import ActorGroup, create_placement_group
from skyrl.train.workers.fsdp_worker import RewardModelWorker


def texts(count: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def episodes(token_ids: list[list[int]]) -> list[Episode]:
    """One episode per text: the text's last 16 tokens are the response."""
    return [
        Episode(
            Trajectory(f"p{i}", f"p{i}/0", [Turn(ids[:-16], ids[-16:], [0.0] * 16, [1] * 16, 0.0)]),
            "done",
            0.0,
        )
        for i, ids in enumerate(token_ids)
    ]


def bare(path: str, token_ids: list[list[int]], batch: int, threads: int, repeats: int) -> float:
    """Seconds per pass over `token_ids`: HF forwards of right-padded batches, the score at each last token."""
    torch.set_num_threads(threads)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32).eval()

    def one_pass() -> list[float]:
        scores = []
        with torch.no_grad():
            for start in range(0, len(token_ids), batch):
                rows = token_ids[start : start + batch]
                width = max(len(r) for r in rows)
                ids = torch.zeros(len(rows), width, dtype=torch.long)
                mask = torch.zeros(len(rows), width, dtype=torch.long)
                for i, r in enumerate(rows):
                    ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
                hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
                last = hidden[torch.arange(len(rows)), mask.sum(-1) - 1]
                scores += model.score(last)[:, 0].tolist()
        return scores

    one_pass()
    start = time.perf_counter()
    for _ in range(repeats):
        one_pass()
    return (time.perf_counter() - start) / repeats


def skyrl(path: str, token_ids: list[list[int]], batch: int, threads: int, repeats: int) -> float:
    """Seconds per pass over `token_ids` through `Rewards.score` and a DP=1 reward-model worker group."""
    cfg = TrainerConfig(
        micro_forward_batch_size_per_gpu=batch, placement=PlacementConfig(cpus_per_worker=threads)
    )
    section = RefConfig(ModelConfig(path=path))
    group = ActorGroup(
        RewardModelWorker, cfg, path, 1, create_placement_group(1, cpus_per_bundle=threads), section=section
    )
    sources = {"env": {"type": "env", "weight": 0.0}, "rm": {"type": "model", "model": path}}
    rewards = Rewards(
        RewardConfig(sources),
        AutoTokenizer.from_pretrained(path),
        "mask",
        WorkerGroups(None, None, None, reward_models={"rm": group}),
        cfg,
    )
    try:
        asyncio.run(rewards.score(episodes(token_ids)))
        start = time.perf_counter()
        for _ in range(repeats):
            asyncio.run(rewards.score(episodes(token_ids)))
        return (time.perf_counter() - start) / repeats
    finally:
        group.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16, help="rows per forward (micro-batch), both sides")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = str(
            create_tiny_model(
                folder,
                hidden_size=args.hidden,
                num_layers=args.layers,
                num_heads=4,
                intermediate_size=4 * args.hidden,
            )
        )
        torch.manual_seed(0)
        AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).save_pretrained(path)
        token_ids = texts(
            args.texts, args.min_len, args.max_len, AutoTokenizer.from_pretrained(path).vocab_size
        )
        bare_s = bare(path, token_ids, args.batch, args.threads, args.repeats)
        ray.init(num_cpus=max(4, args.threads), include_dashboard=False, logging_level="error")
        try:
            skyrl_s = skyrl(path, token_ids, args.batch, args.threads, args.repeats)
        finally:
            ray.shutdown()
    print(f"bare HF forward: {args.texts / bare_s:8.1f} texts/s ({bare_s:.3f} s per batch of {args.texts})")
    print(f"skyrl (worker):  {args.texts / skyrl_s:8.1f} texts/s ({skyrl_s:.3f} s per batch of {args.texts})")
    print(f"ratio skyrl/bare {bare_s / skyrl_s:.2f} (throughput; goal >= 0.9)")


if __name__ == "__main__":
    main()
