"""skyrl: Ray-orchestrated PPO/GRPO training for language-model agents."""

__version__ = "0.1.0"
