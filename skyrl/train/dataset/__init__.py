from skyrl.train.dataset.preprocess import (
    TrainingSequence,
    Trajectory,
    Turn,
    collate_sequences,
    compute_prompt_mini_batch_boundaries,
    trajectories_to_sequences,
)

__all__ = [
    "TrainingSequence",
    "Trajectory",
    "Turn",
    "collate_sequences",
    "compute_prompt_mini_batch_boundaries",
    "trajectories_to_sequences",
]
