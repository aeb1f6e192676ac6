"""The transformers engine's decode loop where completions end at different lengths.

    python bench/decode.py [--repeats 5] [--compile] [--threads 2]

Shape: the `small` model (3M parameters, random init), 64 completions of up to 64 tokens, 2
threads. A random model rarely stops on its own, so 7 of its 259 tokens are made end-of-sequence
tokens: a completion then ends after about 30 tokens on average, at lengths from 1 to 64 (the
issue's measured shape had a mean of 35 of 64). Prints the median seconds per batch and the
completion tokens per second. --compile: the model's forward under torch.compile(dynamic=True),
with the seconds its first (compiling) call took.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tandem.engines.engine import TransformersEngine
from tandem.rollout.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "tandem.cli", "init-model", Path(tmp) / "m", "--size", "small"], check=True, capture_output=True)
        model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "m")
    engine = TransformersEngine(model, eos_token_ids=list(range(100, 107)), pad_token_id=0)
    prompts = [[1, 120, 118, 104, 117, 13, 54 + i % 8, 46, 55] for i in range(64)]
    params = SamplingParams(max_tokens=64)
    if args.compile:
        model.forward = torch.compile(model.forward, dynamic=True)
    start = time.perf_counter()
    engine.generate(prompts, params, list(range(64)))  # warm-up
    print(f"first call: {time.perf_counter() - start:.1f} s")
    seconds, lengths = [], []
    for r in range(args.repeats):
        start = time.perf_counter()
        outs = engine.generate(prompts, params, [1000 * (r + 1) + i for i in range(64)])
        seconds.append(time.perf_counter() - start)
        lengths += [len(o.token_ids) for o in outs]
    median = statistics.median(seconds)
    mean = statistics.mean(lengths)
    print(f"decode: {median:.3f} s per batch of 64, mean length {mean:.1f} of 64, {64 * mean / median:.0f} completion tokens/s")


if __name__ == "__main__":
    main()
