"""What scoring a round costs: a CPU-heavy reward in a thread against worker processes, and
remote-judge rewards awaited one after another against concurrently.

    python bench/rewards.py [--batch 256] [--repeats 5]

Shape 1: the built-in `accuracy` (math-verify) on `--batch` completions that each end in a boxed
fraction, against LaTeX solutions; every answer parses, half are right. reward_num_workers 0 (a
thread of the trainer) against 2 (this machine's cores). The pool's start-up (spawned processes
importing torch) is printed apart: it is paid once per run.

Shape 2: three `async def` judges that each wait 0.2 s per batch, a stand-in for an HTTP call to
a judge model, scored concurrently by tandem; against the same three awaited one after another
(what a loop over reward functions does). Prints medians of `--repeats` batches.
"""

import argparse
import statistics
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

from tandem.rewards import close_rewards, load_rewards, score

JUDGES = """
import asyncio
async def judge_a(prompts, completions, **kw):
    await asyncio.sleep(0.2)
    return [1.0] * len(completions)
judge_b = judge_c = judge_a
"""


def math_batch(n: int, offset: int) -> dict:
    """n completions and solutions; another offset gives other fractions (no cache serves them)."""
    completions, solutions = [], []
    for i in range(offset * n, (offset + 1) * n):
        q = Fraction(i % 17 + 1, i % 5 + 2) + Fraction(1, i % 7 + 2)
        answer = q if i % 2 == 0 else q + 1
        completions.append(f"Adding the two fractions gives \\boxed{{\\frac{{{answer.numerator}}}{{{answer.denominator}}}}}.")
        solutions.append(f"$\\frac{{{q.numerator}}}{{{q.denominator}}}$")
    return {"prompts": ["p"] * n, "completions": completions, "solution": solutions}


def timed(rewards, batches: list[dict]) -> tuple[float, list]:
    """Median seconds of scoring each batch, and the scores."""
    seconds, tables = [], []
    for batch in batches:
        t = time.perf_counter()
        tables.append(score(rewards, **batch).tolist())
        seconds.append(time.perf_counter() - t)
    return statistics.median(seconds), tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256, help="completions per batch")
    ap.add_argument("--repeats", type=int, default=5, help="batches timed per configuration (medians)")
    args = ap.parse_args()

    batches = [math_batch(args.batch, k + 1) for k in range(args.repeats)]
    in_thread = load_rewards(["accuracy"], None)
    score(in_thread, **math_batch(args.batch, 0))  # imports math-verify and sympy
    thread_s, thread_table = timed(in_thread, batches)
    pooled = load_rewards(["accuracy"], None, num_workers=2)
    try:
        t = time.perf_counter()
        score(pooled, **math_batch(args.batch, 0))  # starts the pool; its workers import the same
        startup = time.perf_counter() - t
        pool_s, pool_table = timed(pooled, batches)
    finally:
        close_rewards(pooled)
    if pool_table != thread_table:
        sys.exit("the workers scored differently from the thread")
    print(f"shape 1: accuracy (math-verify), {args.batch} completions per batch, medians of {args.repeats} batches (after one warm-up)")
    print(f"  reward_num_workers 0 (thread): {thread_s:.3f} s/batch")
    print(f"  reward_num_workers 2:          {pool_s:.3f} s/batch ({thread_s / pool_s:.2f}x), first batch with the pool's start-up {startup:.2f} s")

    with tempfile.TemporaryDirectory() as tmp:
        judges = Path(tmp) / "judges.py"
        judges.write_text(JUDGES)
        rewards = load_rewards([f"{judges}:judge_a", f"{judges}:judge_b", f"{judges}:judge_c"], None)
        small = [{"prompts": ["p"] * 8, "completions": ["c"] * 8}] * args.repeats
        together, _ = timed(rewards, small)
        in_turn = statistics.median(sum(timed([r], small[:1])[0] for r in rewards) for _ in range(args.repeats))
    print(f"shape 2: three async judges of 0.2 s each, medians of {args.repeats}")
    print(f"  one after another: {in_turn:.3f} s/batch")
    print(f"  concurrently:      {together:.3f} s/batch ({in_turn / together:.2f}x)")


if __name__ == "__main__":
    main()
