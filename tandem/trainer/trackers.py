"""Experiment trackers (`report_to`, the transformers/TRL name) through accelerate's tracker
classes: the metrics of metrics.jsonl at the same steps, from rank 0, and the logged
completions as a table where the tracker has one (W&B)."""

import importlib.util

# report_to name -> the package it needs
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def check_report_to(report_to: list[str]) -> str | None:
    """Why report_to cannot work (naming the fix), or None."""
    unknown = [r for r in report_to if r not in (*TRACKERS, "none")]
    if unknown:
        return f"{unknown} unknown; give any of {sorted(TRACKERS)}, or none"
    if "none" in report_to and len(report_to) > 1:
        return "none cannot be combined with a tracker"
    missing = [TRACKERS[r] for r in report_to if r in TRACKERS and importlib.util.find_spec(TRACKERS[r]) is None]
    if missing:
        return f"needs the {' and '.join(missing)} package{'s' if len(missing) > 1 else ''}: pip install {' '.join(missing)}"
    return None


def log_with(report_to: list[str]) -> list[str] | None:
    """accelerate's log_with argument."""
    chosen = [r for r in report_to if r != "none"]
    return chosen or None


def hyperparameters(config: dict) -> dict:
    """The run's config as trackers take it: scalars, lists written out."""
    return {k: (", ".join(map(str, v)) if isinstance(v, list) else v) for k, v in config.items()}


def scalars(record: dict) -> dict:
    """The numeric metrics of a metrics.jsonl record (trackers plot numbers)."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


def log_completions(accelerator, lines: list[dict], step: int) -> None:
    """The completions.jsonl lines of a step as a W&B table (the other trackers have none)."""
    if not lines or "wandb" not in [t.name for t in accelerator.trackers]:
        return
    columns = list(lines[0])
    rows = [[v if isinstance(v, (int, float, str)) or v is None else str(v) for v in (line.get(c) for c in columns)] for line in lines]
    accelerator.get_tracker("wandb").log_table("completions", columns=columns, data=rows, step=step)
