"""Training-step throughput through the Ray FSDP2 policy worker (DP=1) vs a bare torch loop.

Both run the same model (a Qwen2-style model built locally), the same batch,
the same micro-batch size, AdamW and the same PPO-clip loss; the bare loop is a
single process with no Ray, no FSDP and no batching classes. Both use the same
number of CPU threads. Prints tokens/s of each and the ratio skyrl / bare.

Usage: python scripts/bench_train.py [--hidden 256] [--layers 4] [--sequences 32] [--length 256]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import ray
import torch

from skyrl.train.dataset.preprocess import compute_prompt_mini_batch_boundaries
from skyrl.train.schema import OptimizerConfig, PlacementConfig, PolicyConfig, TrainerConfig
from skyrl.train.training_batch import TrainingInputBatch
from skyrl.train.utils.tiny_model import create_tiny_model
from skyrl.train.workers.actor_group import ActorGroup, create_placement_group
from skyrl.train.workers.fsdp_worker import PolicyWorker

LR = 1e-5


def make_batch(num_sequences: int, length: int, vocab_size: int) -> TrainingInputBatch:
    gen = torch.Generator().manual_seed(0)
    prompt, response = length // 2, length - length // 2
    batch = TrainingInputBatch(
        {
            "sequences": torch.randint(3, vocab_size, (num_sequences, length), generator=gen),
            "attention_mask": torch.ones(num_sequences, length, dtype=torch.long),
            "response_mask": torch.ones(num_sequences, response, dtype=torch.long),
            "loss_mask": torch.ones(num_sequences, response),
            "advantages": torch.randn(num_sequences, response, generator=gen),
            "old_logprobs": torch.full((num_sequences, response), -6.0),
        }
    )
    batch.metadata["uids"] = [f"p{i}" for i in range(num_sequences)]
    assert prompt > 0
    return batch


def bare_torch_steps(model_path: str, batch: TrainingInputBatch, micro: int, steps: int) -> float:
    """Seconds per optimizer step of a plain single-process loop."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    response = batch["response_mask"].shape[1]
    num_tokens = batch["loss_mask"].sum()

    def step() -> None:
        optimizer.zero_grad()
        for start in range(0, len(batch), micro):
            seq = batch["sequences"][start : start + micro]
            logits = model(input_ids=seq).logits[:, -response - 1 : -1]
            logprobs = logits.gather(-1, seq[:, -response:, None])[..., 0] - logits.logsumexp(-1)
            ratio = (logprobs - batch["old_logprobs"][start : start + micro]).exp()
            adv = batch["advantages"][start : start + micro]
            loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).sum() / num_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def skyrl_steps(
    model_path: str, batch: TrainingInputBatch, micro: int, steps: int, threads: int
) -> tuple[float, int]:
    """Seconds per optimizer step through ActorGroup.train (dispatch, object store, FSDP2 worker), and its threads."""
    cfg = TrainerConfig(
        policy=PolicyConfig(optimizer=OptimizerConfig(lr=LR)),
        micro_train_batch_size_per_gpu=micro,
        placement=PlacementConfig(cpus_per_worker=threads),
    )
    pg = create_placement_group(1, cpus_per_bundle=threads)
    group = ActorGroup(PolicyWorker, cfg, model_path, 1, pg)
    bounds = compute_prompt_mini_batch_boundaries(batch.metadata["uids"], len(batch), len(batch), False, 1)
    try:
        actor_threads = ray.get(group.actors[0].__ray_call__.remote(lambda _: torch.get_num_threads()))
        group.train(batch, bounds)  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            group.train(batch, bounds)
        return (time.perf_counter() - start) / steps, actor_threads
    finally:
        group.kill()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ray.init(num_cpus=args.threads, include_dashboard=False, logging_level="warning")
    with tempfile.TemporaryDirectory() as tmp:
        path = str(
            create_tiny_model(
                tmp,
                hidden_size=args.hidden,
                num_layers=args.layers,
                num_heads=args.hidden // 64,
                intermediate_size=4 * args.hidden,
            )
        )
        batch = make_batch(args.sequences, args.length, 512)
        tokens = int(batch["attention_mask"].sum())
        bare = bare_torch_steps(path, batch, args.micro, args.steps)
        ours, actor_threads = skyrl_steps(path, batch, args.micro, args.steps, args.threads)
    print(
        f"train step, {args.sequences} x {args.length} tokens, hidden {args.hidden} x {args.layers} layers, "
        f"micro-batch {args.micro}: skyrl (Ray + FSDP2, DP=1, {actor_threads} threads) {tokens / ours:,.0f} tokens/s, "
        f"bare torch ({torch.get_num_threads()} threads) {tokens / bare:,.0f} tokens/s, ratio {bare / ours:.3f}"
    )


if __name__ == "__main__":
    main()
