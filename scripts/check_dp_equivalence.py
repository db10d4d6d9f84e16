"""Train the tiny model for 2 optimizer steps on DP=1, on DP=2 and with micro-batch 1, and compare.

The batch is step-wise with a variable number of turns per episode, so
mini-batches hold odd row counts and get padded for DP=2. The loss is the dual-clip
PPO loss plus a KL term against reference logprobs, so every policy metric is live.
Prints per-quantity relative differences, the training metrics (clip_frac,
dual_clip_frac, approx_kl, ratio_*, entropy, kl_loss) included; the LAST line is the largest of the loss, grad-norm,
gradient and metric relative differences over both comparisons (reviews read it).

Usage: python scripts/check_dp_equivalence.py [--model PATH]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from dataclasses import dataclass

import ray
import torch

from skyrl.train.algorithms import compute_stepwise_advantages
from skyrl.train.dataset.preprocess import (
    Trajectory,
    Turn,
    collate_sequences,
    compute_prompt_mini_batch_boundaries,
    trajectories_to_sequences,
)
from skyrl.train.schema import AlgorithmConfig, OptimizerConfig, PolicyConfig, TrainerConfig
from skyrl.train.training_batch import TrainingInputBatch
from skyrl.train.workers.actor_group import ActorGroup, create_placement_group
from skyrl.train.workers.fsdp_worker import PolicyWorker

NUM_PROMPTS, SAMPLES, MINI_BATCH = 4, 2, 2
# the policy's training metrics: token-weighted means and extremes over the whole mini-batch
METRICS = (
    "clip_frac",
    "dual_clip_frac",
    "approx_kl",
    "ratio_mean",
    "ratio_max",
    "ratio_min",
    "entropy",
    "kl_loss",
)
# the loss under test: dual-clip PPO with clip ranges that one step at this learning rate reaches, + KL
ALGORITHM = AlgorithmConfig(
    policy_loss="dual_clip",
    eps_clip_low=0.02,
    eps_clip_high=0.02,
    clip_ratio_c=1.03,
    use_kl_loss=True,
    kl_loss_coef=0.1,
)


def stepwise_batch(vocab_size: int, seed: int = 0) -> tuple[TrainingInputBatch, list[tuple[int, int]]]:
    """Random multi-turn episodes (1-3 turns), rewards 0/1, GRPO step-wise advantages; reference
    logprobs are filled in by `train_two_steps` (the old logprobs, perturbed)."""
    rng = random.Random(seed)
    trajectories = []
    for p in range(NUM_PROMPTS):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(4, 10))]
        for s in range(SAMPLES):
            context, turns = list(prompt), []
            for _ in range(rng.randint(1, 3)):
                response = [rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 6))]
                turns.append(Turn(list(context), response, [0.0] * len(response), [1] * len(response)))
                context += response + [rng.randrange(3, vocab_size) for _ in range(3)]
            turns[-1].reward = float(rng.random() < 0.5)
            trajectories.append(Trajectory(f"p{p}", f"p{p}/{s}", turns))
    batch = collate_sequences(trajectories_to_sequences(trajectories, step_wise=True), pad_token_id=0)
    advantages, _ = compute_stepwise_advantages(
        "grpo",
        batch["rewards"],
        batch["response_mask"],
        batch.metadata["uids"],
        batch.metadata["trajectory_ids"],
        batch.metadata["is_last_step"],
    )
    batch["advantages"] = advantages
    bounds = compute_prompt_mini_batch_boundaries(
        batch.metadata["uids"], MINI_BATCH, NUM_PROMPTS, True, SAMPLES
    )
    return batch, bounds


@dataclass
class RunResult:
    metrics: list[dict[str, float]]  # per optimizer step, as the workers report them
    losses: list[float]
    grad_norms: list[float]
    gradients: list[torch.Tensor]
    update: torch.Tensor  # parameters after the steps minus before, flattened
    num_mini_batches: int


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[k].flatten().double() for k in sorted(state)])


def train_two_steps(
    model_path: str, dp_size: int, micro_batch_size: int = 2, balance: bool = False, delay_split: bool = False
) -> RunResult:
    """Two optimizer steps (one per mini-batch) on a fresh actor group of `dp_size` ranks."""
    from transformers import AutoConfig

    cfg = TrainerConfig(
        policy=PolicyConfig(optimizer=OptimizerConfig(lr=1e-3, max_grad_norm=1.0)),
        micro_train_batch_size_per_gpu=micro_batch_size,
        micro_forward_batch_size_per_gpu=micro_batch_size,
        algorithm=ALGORITHM,
    )
    batch, bounds = stepwise_batch(AutoConfig.from_pretrained(model_path).vocab_size)
    pg = create_placement_group(dp_size)
    group = ActorGroup(PolicyWorker, cfg, model_path, dp_size, pg)
    try:
        before = flat(group.full_state_dict())
        batch["old_logprobs"] = group.forward(group.stage(batch, bounds, balance, delay_split))["logprobs"]
        noise = torch.randn(batch["old_logprobs"].shape, generator=torch.Generator().manual_seed(0))
        batch["ref_logprobs"] = batch["old_logprobs"] + 0.05 * noise
        history, grads = [], []
        for mini in group.stage(batch, bounds, balance, delay_split):
            history += group.train([mini])
            grads.append(group.run("gradient_vector")[0])
        update = flat(group.full_state_dict()) - before
    finally:
        group.kill()
        ray.util.remove_placement_group(pg)
    return RunResult(
        history, [m["loss"] for m in history], [m["grad_norm"] for m in history], grads, update, len(bounds)
    )


def relative_differences(a: RunResult, b: RunResult) -> dict[str, float]:
    def rel(x: torch.Tensor, y: torch.Tensor) -> float:
        return ((x - y).norm() / x.norm().clamp(min=1e-30)).item()

    def rel_scalar(x: float, y: float) -> float:
        return abs(x - y) / max(abs(x), 1e-12) if x != y else 0.0

    diffs = {
        "loss": max(rel_scalar(x, y) for x, y in zip(a.losses, b.losses, strict=True)),
        "grad_norm": max(rel_scalar(x, y) for x, y in zip(a.grad_norms, b.grad_norms, strict=True)),
        "gradient": max(rel(x.double(), y.double()) for x, y in zip(a.gradients, b.gradients, strict=True)),
        "param_update": rel(a.update, b.update),
    }
    for key in METRICS:
        diffs[key] = max(rel_scalar(x[key], y[key]) for x, y in zip(a.metrics, b.metrics, strict=True))
    return diffs


def headline(diffs: dict[str, float]) -> float:
    """The figure the last line prints: every compared quantity except the parameter update."""
    return max(v for k, v in diffs.items() if k != "param_update")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model directory (default: a fresh tiny model)")
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from skyrl.train.utils.tiny_model import create_tiny_model

            args.model = str(create_tiny_model(tmp))
        dp1 = train_two_steps(args.model, 1)
        runs = {"DP=2": train_two_steps(args.model, 2), "micro-batch 1": train_two_steps(args.model, 1, 1)}
    print(f"DP=1, micro-batch 2: losses {dp1.losses} grad norms {dp1.grad_norms}")
    for step, metrics in enumerate(dp1.metrics):
        print(f"  step {step} metrics " + " ".join(f"{k} {metrics[k]:.6g}" for k in METRICS))
    worst = 0.0
    for name, run in runs.items():
        diffs = relative_differences(dp1, run)
        print(f"{name} vs DP=1: " + ", ".join(f"{k} {v:.3e}" for k, v in diffs.items()))
        worst = max(worst, headline(diffs))
    print(f"{worst:.3e}")


if __name__ == "__main__":
    main()
