"""tandem: GRPO training with a rollout engine running in tandem with the trainer."""

__version__ = "0.1.0"
