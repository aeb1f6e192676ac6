"""tandem: GRPO training with a rollout engine running in tandem with the trainer.

`from tandem import GRPOConfig, GRPOTrainer` is TRL's Python API (tandem/api.py), imported on
first use so that the command line starts without torch.
"""

__version__ = "0.1.0"
__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "GRPOConfig", "GRPOTrainer"]


def __getattr__(name: str):
    if name in __all__:
        from tandem import api

        return getattr(api, name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
