"""The training forward and backward where completions end at different lengths: every
completion padded to the longest (one bucket, the loop before length buckets) against the
default length buckets, alternating, in one process.

    python bench/train_forward.py [--repeats 7] [--groups 8 1]

Shape: the `small` model (3M parameters, random init), fp32, 2 threads; each group is one
20-token prompt with 8 completions whose lengths are drawn from an exponential of mean 30,
capped at 64 (mean about 25). `--groups 8` is the benchmark's micro-batch of
64 completions, `--groups 1` the default per_device_train_batch_size of 8. Prints the tokens run
(real and padding), the median seconds of forward + backward, and the speed-up.
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

from tandem.rollout.types import Rollout
from tandem.trainer.batch import MAX_BUCKETS, PrefixSharingLM, collate, completion_logprobs


def rollouts(groups: int, seed: int = 0) -> list[Rollout]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for u in range(groups):
        prompt = torch.randint(3, 250, (20,), generator=g).tolist()
        for _ in range(8):
            n = int(min(64, 1 + torch.empty(1).exponential_(1 / 30, generator=g).item()))
            out.append(Rollout(u, u, prompt, torch.randint(3, 250, (n,), generator=g).tolist(), [0.0] * n, "stop", 0))
    return out


def fwd_bwd(model, batch: list[Rollout], max_buckets: int) -> tuple[float, int]:
    t = time.perf_counter()
    mb = collate(batch, 0, "cpu", False, max_buckets=max_buckets)
    logps, _ = completion_logprobs(model, mb, 1.0, with_entropy=True)
    (logps * mb.completion_mask).sum().backward()
    return time.perf_counter() - t, sum(len(rows) * width for rows, width in mb.buckets)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--groups", type=int, nargs="+", default=[8, 1])
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "tandem.cli", "init-model", Path(tmp) / "m", "--size", "small"], check=True, capture_output=True)
        model = PrefixSharingLM(AutoModelForCausalLM.from_pretrained(Path(tmp) / "m"))
    for groups in args.groups:
        batch = rollouts(groups)
        real = sum(len(r.completion_ids) for r in batch)
        times: dict[int, list[float]] = {1: [], MAX_BUCKETS: []}
        ran = {}
        for rep in range(args.repeats + 1):
            for k in times:  # alternate, so drift hits both
                seconds, ran[k] = fwd_bwd(model, batch, k)
                if rep:  # the first is warm-up
                    times[k].append(seconds)
        one, many = statistics.median(times[1]), statistics.median(times[MAX_BUCKETS])
        print(f"{len(batch)} completions, {real} tokens (mean {real / len(batch):.1f} of at most 64):")
        print(f"  padded to the longest   {ran[1]:>6} tokens run  {one:.3f} s")
        print(f"  length buckets (<= {MAX_BUCKETS})  {ran[MAX_BUCKETS]:>6} tokens run  {many:.3f} s  {one / many:.2f}x faster")


if __name__ == "__main__":
    main()
