"""`tandem plot RUN_DIR [RUN_DIR ...]`: a run's curves from metrics.jsonl as one PNG, several
runs overlaid."""

import json
from pathlib import Path

# (panel title, metrics drawn in it); a panel with none of its metrics in any run is left out.
PANELS = [
    ("reward", ["reward", "rewards/*/mean"]),
    ("completion length", ["completions/mean_length", "completions/min_length", "completions/max_length"]),
    ("truncated ratio", ["completions/truncated_ratio"]),
    ("KL and entropy", ["kl", "entropy"]),
    ("clip ratios", ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]),
    ("staleness (async)", ["staleness/mean", "staleness/max"]),
    ("importance weights", ["kl_behav_proximal", "importance_sampling/*"]),
    ("seconds per phase", ["time/generate", "time/reward", "time/train", "time/weight_sync"]),
    ("completion tokens/s", ["completion_tokens_per_second"]),
]


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: give the output_dir of a `tandem train` run")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _keys(pattern: str, records: list[dict]) -> list[str]:
    """The metric names a panel pattern stands for ('*' matches one name part)."""
    if "*" not in pattern:
        return [pattern] if any(pattern in r for r in records) else []
    head, tail = pattern.split("*")
    found = {k for r in records for k in r if k.startswith(head) and k.endswith(tail) and "/" not in k[len(head) : len(k) - len(tail)]}
    return sorted(found)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (None and NaN left out of each mean)."""
    out = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1) : i + 1] if v is not None and v == v]
        out.append(sum(part) / len(part) if part else float("nan"))
    return out


def plot(run_dirs: list[Path], out: Path, window: int = 1) -> Path:
    """Write the PNG of the runs' curves to `out`; returns it."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("tandem plot needs matplotlib: pip install matplotlib (or pip install 'tandem-rl[plot]')") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    runs = [(Path(d), read_metrics(d)) for d in run_dirs]
    names = [d.name for d, _ in runs]
    if len(set(names)) < len(names):  # e.g. two demos' run/ folders: name them with their parent
        names = [f"{d.parent.name}/{d.name}" for d, _ in runs]
    every = [r for _, records in runs for r in records]
    panels = [(title, [k for p in patterns for k in _keys(p, every)]) for title, patterns in PANELS]
    panels = [(title, keys) for title, keys in panels if keys]
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, (title, keys) in zip(axes.flat, panels):
        for r, (_, records) in enumerate(runs):
            steps = [m["step"] for m in records]
            for j, key in enumerate(keys):
                if not any(key in m for m in records):
                    continue
                label = key if len(runs) == 1 else f"{names[r]}: {key}"
                ax.plot(steps, smooth([m.get(key) for m in records], window), styles[r % len(styles)], color=f"C{j}", label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(", ".join(names) + (f" (moving average over {window} steps)" if window > 1 else ""))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
