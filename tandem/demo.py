"""The bundled demos, on a tiny model and 2 CPU cores: single-digit addition learned by GRPO, and
three-digit addition learned by calling the calculator (`tandem demo --task calculator`).

A randomly initialised model cannot answer at all, so the demo first teaches it the answer
*format* by a short supervised warm-up on questions paired with random numbers: it learns to
reply with a number and stop, but nothing about which number is right (its reward then is
chance). Everything it learns about addition afterwards comes from the RL reward. The tool
demo's warm-up likewise teaches how to call the tool, not that calling pays.
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


# The tool demo: three-digit addition, which the tiny model cannot learn in a run of minutes, with
# the calculator, which it can learn to call. Sums stay below 1,000: one token each in its vocabulary.
LOW, HIGH = 100, 499
CALL_RATE = 0.1  # how often the warmed-up model starts a call; RL has to find that calling pays


def calculator_rows(seed: int, count: int = 2000) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)})
    return rows


def calculator_warmup(tokenizer, seed: int, count: int, tool_share: float = 0.8) -> list[tuple[list[int], list[int]]]:
    """Encoded warm-up conversations: most call the calculator with the question's expression and
    answer with its result, the rest answer with a random guess. The reply's first token, which
    decides whether to call, is in the loss in only enough of the calling ones that the model
    starts a call in about CALL_RATE of its replies: the warm-up teaches how to call and where
    the result comes back, not that calling pays."""
    from tandem.rollout.multiturn import TemplateGlue, encode_conversation
    from tandem.rollout.tools import calculator, make_tool

    glue = TemplateGlue(tokenizer, {"tools": [make_tool(calculator, "calculator").schema]}, "the tool demo's model")
    rng = random.Random(seed + 1)
    keep_first = CALL_RATE * (1 - tool_share) / ((1 - CALL_RATE) * tool_share)
    rows = []
    for _ in range(count):
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        question = [{"role": "user", "content": f"{a}+{b}="}]
        if rng.random() >= tool_share:
            rows.append(encode_conversation(tokenizer, glue, question + [{"role": "assistant", "content": str(rng.randint(2 * LOW, 2 * HIGH))}]))
            continue
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}+{b}"}})
        turns = [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"}, {"role": "tool", "content": str(a + b)},
                 {"role": "assistant", "content": str(a + b)}]  # fmt: skip
        ids, labels = encode_conversation(tokenizer, glue, question + turns)
        if rng.random() >= keep_first:
            first = next(i for i, label in enumerate(labels) if label != -100)
            labels[first] = -100
        rows.append((ids, labels))
    return rows


def prepare_calculator(out: Path, seed: int = 0, warmup_steps: int = 1200, batch_size: int = 16) -> tuple[Path, Path]:
    """The tool demo's warmed-up model and data; returns (model dir, data file)."""
    model_dir = out / "model"
    model, tokenizer = init_model(model_dir, size="tiny", seed=seed, for_tools=True)
    # As many conversations as the warm-up draws: seen about once each, the random
    # guesses cannot be learned by heart.
    rows = calculator_warmup(tokenizer, seed, count=batch_size * warmup_steps)
    warmup_sft(model, tokenizer, rows=rows, steps=warmup_steps, lr=3e-3, batch_size=batch_size, seed=seed)
    save(model, tokenizer, model_dir)
    return model_dir, write_jsonl(calculator_rows(seed), out / "calculator.jsonl")
