"""`python -m skyrl.train`.

The training loop lands with the trainer; until then this entry point walks one
synthetic multi-turn batch through the data plane the trainer is built on.
"""

from __future__ import annotations

import random

from skyrl import __version__
from skyrl.train.dataset.preprocess import (
    Trajectory,
    Turn,
    collate_sequences,
    compute_prompt_mini_batch_boundaries,
    trajectories_to_sequences,
)
from skyrl.train.training_batch import pad_training_input_batch
from skyrl.train.utils.seqlen_balancing import get_seqlen_balanced_partitions

NUM_PROMPTS, SAMPLES, MINI_BATCH, DP_SIZE, MAX_TURNS = 16, 4, 4, 4, 4


def synthetic_episode(rng: random.Random, uid: str, tid: str) -> Trajectory:
    context = [rng.randrange(1, 100) for _ in range(rng.randint(8, 24))]
    turns = []
    for _ in range(rng.randint(1, MAX_TURNS)):
        response = [rng.randrange(1, 100) for _ in range(rng.randint(2, 12))]
        turns.append(Turn(list(context), response, [-1.0] * len(response), [1] * len(response)))
        context += response + [rng.randrange(1, 100) for _ in range(rng.randint(3, 6))]
    turns[-1].reward = float(rng.random() < 0.5)
    return Trajectory(uid, tid, turns)


def max_over_mean(loads: list[int]) -> float:
    return max(loads) / (sum(loads) / len(loads))


def main() -> None:
    rng = random.Random(0)
    print(f"skyrl {__version__}: the training loop lands with the trainer; this run walks the data plane.")
    trajectories = [
        synthetic_episode(rng, f"p{p}", f"p{p}/{s}") for p in range(NUM_PROMPTS) for s in range(SAMPLES)
    ]
    batch = collate_sequences(trajectories_to_sequences(trajectories, step_wise=True), pad_token_id=0)
    print(
        f"{NUM_PROMPTS} prompts x {SAMPLES} samples, 1-{MAX_TURNS} turns each -> {len(batch)} step-wise "
        f"sequences, tensors {tuple(batch['sequences'].shape)}"
    )
    bounds = compute_prompt_mini_batch_boundaries(
        batch.metadata["uids"], MINI_BATCH, NUM_PROMPTS, is_stepwise=True, n_samples_per_prompt=SAMPLES
    )
    for k, (start, end) in enumerate(bounds):
        mini = batch.slice(start, end)
        padded = pad_training_input_batch(mini, (-len(mini)) % DP_SIZE)
        tokens = padded["attention_mask"].sum(-1).tolist()
        strided = [sum(tokens[r::DP_SIZE]) for r in range(DP_SIZE)]
        parts = get_seqlen_balanced_partitions(tokens, DP_SIZE, equal_size=True)
        balanced = [sum(tokens[i] for i in part) for part in parts]
        print(
            f"mini-batch {k}: {MINI_BATCH} prompts, {len(mini)} sequences + "
            f"{padded.metadata.get('pad_size', 0)} pad rows over {DP_SIZE} ranks; "
            f"max/mean tokens per rank strided {max_over_mean(strided):.3f}, balanced {max_over_mean(balanced):.3f}"
        )


if __name__ == "__main__":
    main()
