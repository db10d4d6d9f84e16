"""Training-step throughput and memory through the Ray FSDP2 policy worker (DP=1) vs a bare torch loop.

Every variant runs in a fresh process with the same CPU threads, the same model (a Qwen2-style
model built locally), AdamW and the same PPO-clip loss; the bare loop is a single process with
no Ray, no FSDP and no batching classes, computing full-vocabulary logits of globally padded rows
(the layout every row had before this worker packed them).

`--workload uniform`: random sequences of one length; prints the ratio skyrl / bare.
`--workload stepwise`: agent-like traces (a system prompt, then turns of response + observation)
decomposed step-wise, one row per turn; prints (i) skyrl on per-step rows with fixed-size
micro-batches, (ii) skyrl with prefix-shared rows and token-budget micro-batches, (iii) the bare
loop over the per-step rows; the last line is `ratio new/old` ((ii) over (i)).
`--lora RANK`: the uniform workload through the worker with full fine-tuning and with rank-RANK LoRA
adapters on every projection: trainable parameters, optimizer-state bytes, step time and peak memory
of each; the last line is `ratio lora/full` (step time).
`--sp N`: one sequence of `--length` tokens through the worker on one rank and with Ulysses sequence
parallelism over N ranks (each with `--threads` / N threads): peak memory per rank and seconds per step
of each; the last line is `ratio spN/sp1` (peak memory of the largest rank). With `--memory-cap MIB`,
first the longest sequence that trains at sp=1 and at sp=N within that cap, found by doubling from
`--length` tokens: the cap bounds what a rank's memory grows by during a step (its activations), not
the weights and optimizer state that every length holds alike.
Throughput counts loss tokens (the response tokens trained on); memory is the peak resident
memory a process gained during the timed steps (CPU) or the peak allocated (GPU).

Usage: python scripts/bench_train.py [--workload uniform|stepwise] [--hidden 256] [--layers 4] ...
"""

from __future__ import annotations

import argparse
import random
import resource
import tempfile
import time

import psutil
import ray
import torch

from skyrl.train.dataset.preprocess import (
    Trajectory,
    Turn,
    collate_sequences,
    compute_prompt_mini_batch_boundaries,
    layout_metrics,
    prefix_groups,
    trajectories_to_sequences,
)
from skyrl.train.schema import LoRAConfig, OptimizerConfig, PlacementConfig, PolicyConfig, TrainerConfig
from skyrl.train.training_batch import TrainingInputBatch
from skyrl.train.utils.tiny_model import create_tiny_model
from skyrl.train.workers.actor_group import ActorGroup, create_placement_group
from skyrl.train.workers.fsdp_worker import PolicyWorker

LR = 1e-5
VOCAB = 512


def training_fields(batch: TrainingInputBatch, seed: int = 0) -> TrainingInputBatch:
    gen = torch.Generator().manual_seed(seed)
    shape = batch["response_mask"].shape
    batch["loss_mask"] = batch["response_mask"].float()
    batch["advantages"] = torch.randn(shape, generator=gen) * batch["loss_mask"]
    batch["old_logprobs"] = torch.full(shape, -6.0)
    return batch


def uniform_batch(num_sequences: int, length: int) -> TrainingInputBatch:
    gen = torch.Generator().manual_seed(0)
    response = length - length // 2
    batch = TrainingInputBatch(
        {
            "sequences": torch.randint(3, VOCAB, (num_sequences, length), generator=gen),
            "attention_mask": torch.ones(num_sequences, length, dtype=torch.long),
            "response_mask": torch.ones(num_sequences, response, dtype=torch.long),
        }
    )
    batch.metadata["uids"] = [f"p{i}" for i in range(num_sequences)]
    return training_fields(batch)


def stepwise_batch(trajectories: int, turns: int, system: int, share_prefixes: bool) -> TrainingInputBatch:
    """Agent-like traces: a `system`-token prompt, then `turns` turns of a 50-300-token response and
    a 20-200-token observation, contexts extending each other token-exactly; one row per turn."""
    rng = random.Random(0)
    episodes = []
    for t in range(trajectories):
        context, steps = [rng.randrange(3, VOCAB) for _ in range(system)], []
        for _ in range(turns):
            response = [rng.randrange(3, VOCAB) for _ in range(rng.randint(50, 300))]
            steps.append(Turn(list(context), response, [0.0] * len(response), [1] * len(response)))
            context += response + [rng.randrange(3, VOCAB) for _ in range(rng.randint(20, 200))]
        episodes.append(Trajectory(f"p{t}", f"p{t}/0", steps))
    sequences = trajectories_to_sequences(episodes, step_wise=True)
    batch = collate_sequences(sequences, pad_token_id=0)
    batch["prefix_group"] = torch.tensor(
        prefix_groups(sequences) if share_prefixes else range(len(sequences))
    )
    return training_fields(batch)


def peak_memory_probe() -> tuple[float, bool]:
    """What the probe reads now: current RSS (CPU) or resets the GPU peak."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return float(torch.cuda.memory_allocated()), True
    return float(psutil.Process().memory_info().rss), False


def peak_memory_since(start: tuple[float, bool]) -> float:
    base, gpu = start
    peak = (
        torch.cuda.max_memory_allocated()
        if gpu
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return max(0.0, peak - base)


@ray.remote
def bare_torch_steps(model_path: str, batch: TrainingInputBatch, micro: int, steps: int, threads: int):
    """Seconds per optimizer step of a plain single-process loop, and its peak memory growth."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    response = batch["response_mask"].shape[1]
    num_tokens = batch["loss_mask"].sum()

    def step() -> None:
        optimizer.zero_grad()
        for start in range(0, len(batch), micro):
            rows = slice(start, start + micro)
            seq, mask = batch["sequences"][rows], batch["attention_mask"][rows]
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=seq, attention_mask=mask, position_ids=positions).logits
            logits = logits[:, -response - 1 : -1].float()
            logprobs = logits.gather(-1, seq[:, -response:, None])[..., 0] - logits.logsumexp(-1)
            ratio = (logprobs - batch["old_logprobs"][rows]).exp()
            adv, loss_mask = batch["advantages"][rows], batch["loss_mask"][rows]
            surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
            ((surrogate * loss_mask).sum() / num_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    step()  # warm-up
    probe = peak_memory_probe()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps, peak_memory_since(probe)


def optimizer_footprint(worker: PolicyWorker) -> tuple[int, int]:
    """A worker's trainable parameters and the bytes of its optimizer state (Adam's moments)."""
    state = [t for s in worker.optimizer.state.values() for t in s.values() if t.dim() > 0]
    return sum(p.numel() for p in worker._trainable()), sum(t.numel() * t.element_size() for t in state)


def skyrl_steps(
    model_path: str,
    batch: TrainingInputBatch,
    micro: int,
    max_tokens: int | None,
    steps: int,
    threads: int,
    lora_rank: int = 0,
    sp: int = 1,
) -> tuple[float, float, tuple[int, int]]:
    """Seconds per optimizer step through ActorGroup.train (dispatch, object store, FSDP2 worker) on one
    rank, or on `sp` sequence-parallel ranks of `threads / sp` threads each; the largest peak memory growth
    of a rank, and rank 0's trainable parameters and optimizer-state bytes."""
    cfg = TrainerConfig(
        policy=PolicyConfig(
            optimizer=OptimizerConfig(lr=LR),
            lora=LoRAConfig(rank=lora_rank, alpha=2.0 * lora_rank),
            sequence_parallel_size=sp,
        ),
        micro_train_batch_size_per_gpu=micro,
        max_tokens_per_micro_batch=max_tokens,
        placement=PlacementConfig(cpus_per_worker=max(1, threads // sp)),
    )
    pg = create_placement_group(sp, cpus_per_bundle=max(1, threads // sp))
    group = ActorGroup(PolicyWorker, cfg, model_path, sp, pg)
    uids = [f"p{i}" for i in range(len(batch))] if "uids" not in batch.metadata else batch.metadata["uids"]
    prompts = len(dict.fromkeys(uids))
    bounds = compute_prompt_mini_batch_boundaries(uids, prompts, prompts, True, 1)
    try:
        group.train(group.stage(batch, bounds))  # warm-up
        probes = ray.get([actor.__ray_call__.remote(lambda _: peak_memory_probe()) for actor in group.actors])
        start = time.perf_counter()
        for _ in range(steps):
            group.train(group.stage(batch, bounds))
        seconds = (time.perf_counter() - start) / steps
        peaks = ray.get(
            [
                actor.__ray_call__.remote(lambda _, p: peak_memory_since(p), probe)
                for actor, probe in zip(group.actors, probes, strict=True)
            ]
        )
        return seconds, max(peaks), ray.get(group.actors[0].__ray_call__.remote(optimizer_footprint))
    finally:
        group.kill()
        ray.util.remove_placement_group(pg)


def longest_within(model_path: str, cap: float, length: int, threads: int, sp: int) -> int:
    """The longest sequence, doubling from `length` tokens, whose training step grows the largest of `sp`
    ranks' peak memory by at most `cap` bytes (0: not even `length`)."""
    longest = 0
    while True:
        _, peak, _ = skyrl_steps(model_path, uniform_batch(1, length), 1, None, 1, threads, sp=sp)
        print(f"sp={sp}: {length} tokens, peak memory per rank +{peak / 2**20:.0f} MiB", flush=True)
        if peak > cap:
            return longest
        longest, length = length, 2 * length


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=["uniform", "stepwise"], default="uniform")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=32, help="uniform: rows")
    parser.add_argument("--length", type=int, default=256, help="uniform: tokens per row")
    parser.add_argument("--trajectories", type=int, default=8, help="stepwise")
    parser.add_argument("--turns", type=int, default=8, help="stepwise")
    parser.add_argument("--system", type=int, default=200, help="stepwise: system prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=8192, help="stepwise: the new path's token budget")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA vs full fine-tuning")
    parser.add_argument("--sp", type=int, default=0, metavar="N", help="sequence parallelism vs one rank")
    parser.add_argument(
        "--memory-cap", type=float, default=0, metavar="MIB", help="--sp: the longest sequence within MIB"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ray.init(num_cpus=args.threads, include_dashboard=False, logging_level="warning")
    mib = 1 / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        path = str(
            create_tiny_model(
                tmp,
                hidden_size=args.hidden,
                num_layers=args.layers,
                num_heads=args.hidden // 64,
                intermediate_size=4 * args.hidden,
                vocab_size=VOCAB,
            )
        )
        model = f"hidden {args.hidden} x {args.layers} layers, {args.threads} threads"
        if args.sp:
            if args.memory_cap:
                longest = {
                    size: longest_within(path, args.memory_cap / mib, args.length, args.threads, size)
                    for size in (1, args.sp)
                }
                print(
                    f"longest sequence within +{args.memory_cap:.0f} MiB per rank ({model}): "
                    + ", ".join(f"sp={size} {tokens:,} tokens" for size, tokens in longest.items())
                )
            batch = uniform_batch(1, args.length)
            runs = {
                size: skyrl_steps(path, batch, 1, None, args.steps, args.threads, sp=size)
                for size in (1, args.sp)
            }
            print(f"one sequence of {args.length} tokens, {model}")
            for size, (seconds, peak, _) in runs.items():
                print(f"sp={size}: {seconds:.2f} s/step, peak memory per rank +{peak * mib:.0f} MiB")
            one_rank = runs[1][1]
            if one_rank:
                print(f"ratio sp{args.sp}/sp1 {runs[args.sp][1] / one_rank:.3f}")
            else:  # a short step stays under the peak the process reached before it (loading the model)
                print(f"ratio sp{args.sp}/sp1 n/a: one rank's memory did not grow past its earlier peak")
            return
        if args.lora:
            batch = uniform_batch(args.sequences, args.length)
            runs = {
                name: skyrl_steps(path, batch, args.micro, None, args.steps, args.threads, rank)
                for name, rank in (("full", 0), (f"lora rank {args.lora}", args.lora))
            }
            print(f"uniform: {args.sequences} x {args.length} tokens, {model}, micro-batch {args.micro}")
            for name, (seconds, peak, (params, state)) in runs.items():
                print(
                    f"{name}: {params:,} trainable parameters, optimizer state {state * mib:.2f} MiB, "
                    f"{seconds:.2f} s/step, peak +{peak * mib:.0f} MiB"
                )
            (full, *_), (lora, *_) = runs.values()
            print(f"ratio lora/full {lora / full:.3f}")
            return
        if args.workload == "uniform":
            batch = uniform_batch(args.sequences, args.length)
            loss_tokens = float(batch["loss_mask"].sum())
            bare, bare_mem = ray.get(
                bare_torch_steps.remote(path, batch, args.micro, args.steps, args.threads)
            )
            ours, ours_mem, _ = skyrl_steps(path, batch, args.micro, None, args.steps, args.threads)
            print(
                f"uniform: {args.sequences} x {args.length} tokens, {model}, micro-batch {args.micro}: "
                f"skyrl {loss_tokens / ours:,.0f} loss tokens/s (+{ours_mem * mib:.0f} MiB), "
                f"bare torch {loss_tokens / bare:,.0f} (+{bare_mem * mib:.0f} MiB)"
            )
            print(f"ratio skyrl/bare {bare / ours:.3f}")
            return
        per_step = stepwise_batch(args.trajectories, args.turns, args.system, share_prefixes=False)
        shared = stepwise_batch(args.trajectories, args.turns, args.system, share_prefixes=True)
        loss_tokens = float(per_step["loss_mask"].sum())
        tokens = layout_metrics(
            shared["prefix_group"], shared["attention_mask"], shared.metadata["trajectory_ids"]
        )
        print(
            f"stepwise: {args.trajectories} trajectories x {args.turns} turns = {len(per_step)} rows, {model}; "
            f"{loss_tokens:,.0f} loss tokens; the rows hold {tokens['batch/stepwise_tokens']:,.0f} tokens, "
            f"{tokens['batch/trained_tokens']:,.0f} prefix-shared, {per_step['sequences'].numel():,} padded"
        )
        old, old_mem, _ = skyrl_steps(path, per_step, args.micro, None, args.steps, args.threads)
        print(
            f"(i) skyrl, per-step rows, micro-batches of {args.micro} rows: {loss_tokens / old:,.0f} loss "
            f"tokens/s, {old:.2f} s/step, peak +{old_mem * mib:.0f} MiB"
        )
        new, new_mem, _ = skyrl_steps(path, shared, args.micro, args.max_tokens, args.steps, args.threads)
        print(
            f"(ii) skyrl, prefix-shared rows, {args.max_tokens}-token micro-batches: {loss_tokens / new:,.0f} "
            f"loss tokens/s, {new:.2f} s/step, peak +{new_mem * mib:.0f} MiB"
        )
        bare, bare_mem = ray.get(
            bare_torch_steps.remote(path, per_step, args.micro, args.steps, args.threads)
        )
        print(
            f"(iii) bare torch, per-step rows padded to {tuple(per_step['sequences'].shape)}, micro-batches of "
            f"{args.micro}: {loss_tokens / bare:,.0f} loss tokens/s, {bare:.2f} s/step, peak +{bare_mem * mib:.0f} MiB"
        )
        print(f"new/bare {bare / new:.3f}")
        print(f"ratio new/old {old / new:.3f}")


if __name__ == "__main__":
    main()
