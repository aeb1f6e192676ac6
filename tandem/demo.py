"""The bundled demo: single-digit addition learned by GRPO on a tiny model, on 2 CPU cores.

A randomly initialised model cannot answer at all, so the demo first teaches it the answer
*format* by a short supervised warm-up on questions paired with random numbers: it learns to
reply with a number and stop, but nothing about which number is right (its reward then is
chance). Everything it learns about addition afterwards comes from the RL reward.
"""

import json
import random
from pathlib import Path

from tandem.init_model import init_model, save, warmup_sft

MAX_OPERAND = 9
NOISE = 2


def addition_rows(seed: int) -> list[dict]:
    rows = [
        {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
        for a in range(MAX_OPERAND + 1)
        for b in range(MAX_OPERAND + 1)
    ]
    random.Random(seed).shuffle(rows)
    return rows


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return path


def warmup_pairs(seed: int) -> list[tuple[str, str]]:
    """Each question with an answer that is off by -2..2 at random: the model learns the format and
    roughly where the sum lies, so it starts near 1 in 5 right; RL has to find the exact sums."""
    rng = random.Random(seed + 1)
    return [
        (f"{a}+{b}=", str(max(0, a + b + rng.randint(-NOISE, NOISE))))
        for a in range(MAX_OPERAND + 1)
        for b in range(MAX_OPERAND + 1)
        for _ in range(8)
    ]


def prepare(out: Path, seed: int = 0, size: str = "tiny", warmup_steps: int = 300, head_dim: int = 0) -> tuple[Path, Path]:
    """Writes the data and the format-warmed model; returns (model dir, data file)."""
    model_dir = out / "model"
    model, tokenizer = init_model(model_dir, size=size, seed=seed, head_dim=head_dim)
    # Larger models need a smaller step: after 300 steps the `small` model (heads of 64) ends at
    # a loss of 1.23 with 3e-3 and 0.80 with 1e-3, where `tiny` ends at 0.81 with 3e-3.
    lr = 3e-3 if size == "tiny" else 1e-3
    warmup_sft(model, tokenizer, warmup_pairs(seed), steps=warmup_steps, lr=lr, seed=seed)
    save(model, tokenizer, model_dir)
    data = write_jsonl(addition_rows(seed), out / "addition.jsonl")
    return model_dir, data
