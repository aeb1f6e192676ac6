"""Server sync against server async with default settings, as a new user runs them: no taskset,
no thread flags, no environment variables; the server and the trainer share the host's cores.

    python bench/default_settings.py [--steps 12] [--warmup 3] [--bf16]

Shape (generation-heavy): the `small` model (3M parameters), 8 prompts x 8 completions of up to
64 tokens per step, exact_match on the demo's addition prompts, lr 1e-4. Prints the median
seconds per step and completion tokens per second after the first --warmup steps, the seconds of
generation and training, and how far the server's log-probs are from the trainer's
(kl_behav_proximal, and the largest per-token log-ratio). --bf16: the server holds bf16 weights
(--dtype bfloat16) and the trainer computes under bf16 autocast (--bf16 true).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import start_server, timed_server_run  # bench/common.py
from tandem.demo import addition_rows, write_jsonl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # defaults: nothing set
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        subprocess.run([sys.executable, "-m", "tandem.cli", "init-model", tmp / "model", "--size", "small"], check=True, capture_output=True)
        write_jsonl(addition_rows(0), tmp / "data.jsonl")
        server, url = start_server(tmp / "model", "--dtype", "bfloat16" if args.bf16 else "float32")
        try:
            for mode in ("sync", "async"):
                step, tokens, m = timed_server_run(url, tmp / "model", tmp / "data.jsonl", tmp / mode, mode, args.steps, args.warmup,
                                                   "--bf16", str(args.bf16).lower(), env=env)  # fmt: skip
                gen, train = (statistics.median(x[f"time/{k}"] for x in m) for k in ("generate", "train"))
                kl = statistics.median(x["kl_behav_proximal"] for x in m)
                ratio = max(max(abs(x["is_log_ratio/max"]), abs(x["is_log_ratio/min"])) for x in m)
                print(f"server {mode:<5} {'bf16' if args.bf16 else 'fp32'}  {step:.2f} s/step  {tokens:.0f} completion tokens/s  "
                      f"generate {gen:.2f} s  train {train:.2f} s  kl_behav_proximal {kl:.1e}  max |log-ratio| {ratio:.3f}", flush=True)  # fmt: skip
        finally:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
