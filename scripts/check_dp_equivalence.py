"""Train the tiny model for 2 optimizer steps in every compute layout and compare with the plain path.

The plain path: per-step rows on one rank, fixed micro-batches of 2 rows. The layouts
(`COMPARISONS`): DP=2 (strided, KK-balanced, delayed split), micro-batch 1, token-budget
micro-batches, prefix-shared step-wise rows (a trajectory's steps computed as one
sequence), and Ulysses sequence parallelism (SP=2, and DP=2 x SP=2 on 4 ranks), for every
loss reduction and advantage estimator (GAE with a critic, whose loss and metrics are
compared too), and the forward pass's logprobs and values before training. The batch is step-wise with a variable number of
turns per episode, so mini-batches hold odd row counts and get padded for DP=2. The loss is the dual-clip
PPO loss plus a KL term against reference logprobs, so every policy metric is live.
Prints per-quantity relative differences, the training metrics (clip_frac,
dual_clip_frac, approx_kl, ratio_*, entropy, kl_loss) included; the LAST line is the largest of the loss, grad-norm,
gradient and metric relative differences over both comparisons (reviews read it).

With `--lora RANK` the policy (and critic) train rank-RANK LoRA adapters in every run, plain path included.

Usage: python scripts/check_dp_equivalence.py [--model PATH] [--lora RANK]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from dataclasses import dataclass, replace

import ray
import torch
from ray.util.placement_group import PlacementGroup

from skyrl.train.algorithms import compute_stepwise_advantages
from skyrl.train.dataset.preprocess import (
    Trajectory,
    Turn,
    collate_sequences,
    compute_prompt_mini_batch_boundaries,
    prefix_groups,
    trajectories_to_sequences,
)
from skyrl.train.schema import (
    AlgorithmConfig,
    CriticConfig,
    LoRAConfig,
    ModelConfig,
    OptimizerConfig,
    PolicyConfig,
    TrainerConfig,
)
from skyrl.train.training_batch import TrainingInputBatch
from skyrl.train.workers.actor_group import ActorGroup, create_placement_group
from skyrl.train.workers.fsdp_worker import CriticWorker, FSDPWorker, PolicyWorker

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
CRITIC_METRICS = ("critic/loss", "critic/grad_norm", "critic/vf_clip_frac")
MAX_SEQ_LEN = 32  # seq_mean_token_sum_norm's constant
# the loss under test: dual-clip PPO with clip ranges that one step at this learning rate reaches, + KL
ALGORITHM = AlgorithmConfig(
    policy_loss="dual_clip",
    eps_clip_low=0.02,
    eps_clip_high=0.02,
    clip_ratio_c=1.03,
    use_kl_loss=True,
    kl_loss_coef=0.1,
    entropy_coeff=0.01,
)


def stepwise_batch(
    vocab_size: int, seed: int = 0, share_prefixes: bool = False
) -> tuple[TrainingInputBatch, list[tuple[int, int]]]:
    """Random multi-turn episodes (1-3 turns, contexts extending each other token-exactly), rewards
    0/1, GRPO step-wise advantages, and the mini-batch boundaries; with `share_prefixes` the steps of a
    trajectory form one prefix group (computed as one sequence), otherwise every row is its own."""
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
    sequences = trajectories_to_sequences(trajectories, step_wise=True)
    batch = collate_sequences(sequences, pad_token_id=0)
    batch["prefix_group"] = torch.tensor(
        prefix_groups(sequences) if share_prefixes else range(len(sequences))
    )
    meta = batch.metadata
    batch["advantages"], _ = compute_stepwise_advantages(
        "grpo",
        batch["rewards"],
        batch["response_mask"],
        meta["uids"],
        meta["trajectory_ids"],
        meta["is_last_step"],
    )
    bounds = compute_prompt_mini_batch_boundaries(meta["uids"], MINI_BATCH, NUM_PROMPTS, True, SAMPLES)
    return batch, bounds


@dataclass
class Layout:
    """How the rows are computed; every layout must train like `Layout()` on one rank."""

    dp_size: int = 1
    sp_size: int = 1  # Ulysses sequence parallelism: dp_size x sp_size ranks
    micro_batch_size: int = 2
    balance: bool = False
    delay_split: bool = False
    share_prefixes: bool = False
    max_tokens: int | None = None  # token-budget micro-batches
    gradient_checkpointing: bool = False
    attn: str = "sdpa"  # varlen: packed micro-batches
    lora_rank: int = 0  # LoRA adapters on the policy and critic (0: full fine-tuning)


@dataclass
class RunResult:
    metrics: list[dict[str, float]]  # per optimizer step, as the workers report them (critic/* too)
    losses: list[float]
    grad_norms: list[float]
    gradients: list[torch.Tensor]
    update: torch.Tensor  # parameters after the steps minus before, flattened
    num_mini_batches: int
    forward: torch.Tensor  # the forward pass's outputs before training: logprobs (and the critic's values)


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[k].flatten().double() for k in sorted(state)])


class WorkerPool:
    """Actor groups kept across `train_two_steps` runs, one per (worker class, ranks) on a placement group
    of its own: a run hands the group its config and reloads the model (`init_model`, ~0.03 s on the tiny
    model) instead of starting new processes (~5 s each on 2 cores, mostly imports). The groups hold at
    most `capacity` ranks (a CPU each): the least recently used ones go to make room."""

    def __init__(self, model_path: str, capacity: int = 8):
        self.model_path, self.capacity = model_path, capacity
        self.groups: dict[tuple[type[FSDPWorker], int], tuple[ActorGroup, PlacementGroup]] = {}

    def group(self, worker_cls: type[FSDPWorker], size: int, cfg: TrainerConfig) -> ActorGroup:
        """`size` ranks of `worker_cls` with a freshly loaded model and optimizer, configured by `cfg`."""
        key = (worker_cls, size)
        if key in self.groups:
            self.groups[key] = self.groups.pop(key)  # the most recently used last
            group = self.groups[key][0]
            group.reconfigure(cfg)
            return group
        while self.groups and sum(g.num_workers for g, _ in self.groups.values()) + size > self.capacity:
            group, pg = self.groups.pop(next(iter(self.groups)))
            group.kill()
            ray.util.remove_placement_group(pg)
        pg = create_placement_group(size)
        group = ActorGroup(worker_cls, cfg, self.model_path, size, pg)
        self.groups[key] = group, pg
        return group

    def close(self) -> None:
        for group, pg in self.groups.values():
            group.kill()
            ray.util.remove_placement_group(pg)
        self.groups.clear()


def train_two_steps(
    model_path: str,
    layout: Layout | None = None,
    estimator: str = "grpo",
    reduction: str = "token_mean",
    pool: WorkerPool | None = None,
) -> RunResult:
    """Two optimizer steps (one per mini-batch) on actor groups laid out as `layout`: the policy, and with
    `estimator=gae` a critic whose values make the advantages and which trains first. The groups come
    from `pool` (reloaded), or are started for this run and killed after it."""
    from transformers import AutoConfig

    layout = layout or Layout()
    lora = LoRAConfig(rank=layout.lora_rank, alpha=2.0 * layout.lora_rank)
    cfg = TrainerConfig(
        policy=PolicyConfig(
            model=ModelConfig(
                gradient_checkpointing=layout.gradient_checkpointing, attn_implementation=layout.attn
            ),
            optimizer=OptimizerConfig(lr=1e-3, max_grad_norm=1.0),
            lora=lora,
            sequence_parallel_size=layout.sp_size,
        ),
        critic=CriticConfig(
            model=ModelConfig(path=None, attn_implementation=layout.attn),
            lora=lora,
            sequence_parallel_size=layout.sp_size,
        ),
        micro_train_batch_size_per_gpu=layout.micro_batch_size,
        micro_forward_batch_size_per_gpu=layout.micro_batch_size,
        max_tokens_per_micro_batch=layout.max_tokens,
        algorithm=replace(ALGORITHM, loss_reduction=reduction, max_seq_len=MAX_SEQ_LEN),
    )
    vocab_size = AutoConfig.from_pretrained(model_path).vocab_size
    batch, bounds = stepwise_batch(vocab_size, share_prefixes=layout.share_prefixes)
    meta = batch.metadata
    split = (layout.balance, layout.delay_split)
    own_pool = pool is None
    pool = pool or WorkerPool(model_path)
    try:
        ranks = layout.dp_size * layout.sp_size
        policy = pool.group(PolicyWorker, ranks, cfg)
        critic = pool.group(CriticWorker, ranks, cfg) if estimator == "gae" else None
        before = flat(policy.full_state_dict())
        batch["old_logprobs"] = policy.forward(policy.stage(batch, bounds, *split))["logprobs"]
        noise = torch.randn(batch["old_logprobs"].shape, generator=torch.Generator().manual_seed(0))
        batch["ref_logprobs"] = batch["old_logprobs"] + 0.05 * noise
        values = critic.forward(critic.stage(batch, bounds, *split))["values"] if critic else None
        batch["old_values"] = values if critic else torch.zeros_like(batch["old_logprobs"])
        batch["advantages"], batch["returns"] = compute_stepwise_advantages(
            estimator,
            batch["rewards"],
            batch["response_mask"],
            meta["uids"],
            meta["trajectory_ids"],
            meta["is_last_step"],
            values,
        )
        history, grads = [], []
        for mini in policy.stage(batch, bounds, *split):
            step = {f"critic/{k}": v for k, v in critic.train([mini])[0].items()} if critic else {}
            history.append(step | policy.train([mini], keep_gradients=True)[0])
            grads.append(policy.run("gradient_vector")[0])
        update = flat(policy.full_state_dict()) - before
    finally:
        if own_pool:
            pool.close()
    forward = torch.cat([batch["old_logprobs"], batch["old_values"]], 1)
    return RunResult(
        history,
        [m["loss"] for m in history],
        [m["grad_norm"] for m in history],
        grads,
        update,
        len(bounds),
        forward,
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
        "forward": rel(a.forward.double(), b.forward.double()),
    }
    for key in [*METRICS, *CRITIC_METRICS]:
        if key in a.metrics[0]:
            diffs[key] = max(rel_scalar(x[key], y[key]) for x, y in zip(a.metrics, b.metrics, strict=True))
    return diffs


def headline(diffs: dict[str, float]) -> float:
    """The figure the last line prints: every compared quantity except the parameter update."""
    return max(v for k, v in diffs.items() if k != "param_update")


# (name, advantage estimator, loss reduction, layout): each must train like Layout() with the same
# estimator and reduction (the plain path: per-step rows, one rank, fixed micro-batches of 2 rows)
SHARED_DP2 = Layout(dp_size=2, balance=True, share_prefixes=True, max_tokens=24)
COMPARISONS = [
    ("DP=2", "grpo", "token_mean", Layout(dp_size=2)),
    ("micro-batch 1", "grpo", "token_mean", Layout(micro_batch_size=1)),
    ("DP=2 balanced", "grpo", "token_mean", Layout(dp_size=2, balance=True)),
    ("DP=2 balanced, delayed split", "grpo", "token_mean", Layout(dp_size=2, balance=True, delay_split=True)),
    ("prefix-shared", "grpo", "token_mean", Layout(share_prefixes=True)),
    ("token budget 1 (a sequence each)", "grpo", "token_mean", Layout(max_tokens=1)),
    (
        "token budget 1000 (the whole rank)",
        "grpo",
        "token_mean",
        Layout(share_prefixes=True, max_tokens=1000),
    ),
    ("prefix-shared, DP=2, budget 24", "grpo", "token_mean", SHARED_DP2),
    ("prefix-shared, DP=2, delayed", "grpo", "token_mean", replace(SHARED_DP2, delay_split=True)),
    (
        "gradient checkpointing, prefix-shared, DP=2",
        "grpo",
        "token_mean",
        replace(SHARED_DP2, gradient_checkpointing=True),
    ),
    ("sequence_mean, prefix-shared, DP=2", "grpo", "sequence_mean", SHARED_DP2),
    ("seq_mean_token_sum_norm, prefix-shared, DP=2", "grpo", "seq_mean_token_sum_norm", SHARED_DP2),
    ("rloo, prefix-shared, DP=2", "rloo", "token_mean", SHARED_DP2),
    ("reinforce++, prefix-shared, DP=2", "reinforce++", "token_mean", SHARED_DP2),
    ("gae + critic, prefix-shared, DP=2", "gae", "token_mean", SHARED_DP2),
    # Ulysses sequence parallelism (last: the pool makes room for its groups by closing the ones above)
    ("SP=2", "grpo", "token_mean", Layout(sp_size=2)),
    ("SP=2, gradient checkpointing", "grpo", "token_mean", Layout(sp_size=2, gradient_checkpointing=True)),
    (
        "SP=2, prefix-shared, budget 24, packed (varlen)",
        "grpo",
        "token_mean",
        Layout(sp_size=2, share_prefixes=True, max_tokens=24, attn="varlen"),
    ),
    ("gae + critic, SP=2, prefix-shared", "gae", "token_mean", Layout(sp_size=2, share_prefixes=True)),
    ("DP=2 x SP=2, prefix-shared, budget 24", "grpo", "token_mean", replace(SHARED_DP2, sp_size=2)),
    (
        "DP=2 x SP=2, prefix-shared, budget 24, delayed",
        "grpo",
        "token_mean",
        replace(SHARED_DP2, sp_size=2, delay_split=True),
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model directory (default: a fresh tiny model)")
    parser.add_argument(
        "--lora", type=int, default=0, metavar="RANK", help="train LoRA adapters of this rank"
    )
    args = parser.parse_args()
    plain_layout = Layout(lora_rank=args.lora)
    # the pool's groups (the policy and the critic on 1, 2 and 4 ranks), a CPU a rank, 8 at a time
    ray.init(num_cpus=8, include_dashboard=False, logging_level="warning")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from skyrl.train.utils.tiny_model import create_tiny_model

            args.model = str(create_tiny_model(tmp))
        plain: dict[tuple[str, str], RunResult] = {}
        pool = WorkerPool(args.model)
        try:
            for name, estimator, reduction, layout in COMPARISONS:
                if (estimator, reduction) not in plain:
                    base = plain[estimator, reduction] = train_two_steps(
                        args.model, plain_layout, estimator, reduction, pool
                    )
                    print(f"plain {estimator}/{reduction}: losses {base.losses} grad norms {base.grad_norms}")
                    for step, metrics in enumerate(base.metrics):
                        print(f"  step {step} metrics " + " ".join(f"{k} {metrics[k]:.6g}" for k in METRICS))
                diffs = relative_differences(
                    plain[estimator, reduction],
                    train_two_steps(
                        args.model, replace(layout, lora_rank=args.lora), estimator, reduction, pool
                    ),
                )
                print(f"{name} vs plain: " + ", ".join(f"{k} {v:.3e}" for k, v in diffs.items()))
                worst = max(worst, headline(diffs))
        finally:
            pool.close()
    print(f"{worst:.3e}")


if __name__ == "__main__":
    main()
