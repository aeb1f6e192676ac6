"""Sync vs async generation against a rollout server, each on its own core.

    python bench/async_overlap.py [--steps 14] [--warmup 4] [--repeats 2]

The server runs on core 1 (taskset, 1 torch thread), the trainer on core 0 (taskset,
OMP_NUM_THREADS=1), with the `small` model from `tandem init-model` (~3M parameters) and
completions that run to max_completion_length, so generation and training each take about
the same time. Runs alternate sync, async, sync, async so drift hits both. Reported per step
(medians over the steps after the warm-up):
  generate   the engine call of one round (sync runs)
  train      forward/backward/optimizer plus the weight push (sync runs)
  step       wall time between consecutive optimizer steps
  speedup    sync step / async step
  efficiency speedup / ((generate + train) / max(generate, train)), 1.0 = perfect overlap
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import start_server  # bench/common.py
from tandem.demo import addition_rows, write_jsonl

REWARD = "def digits(prompts, completions, **kw):\n    return [sum(ch.isdigit() for ch in c[-1]['content']) / max(1, len(c[-1]['content'])) for c in completions]\n"


def pinned(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if shutil.which("taskset") else []


def run_trainer(args, tmp: Path, url: str, mode: str, rep: int) -> dict:
    out = tmp / f"{mode}-{rep}"
    cmd = pinned(0) + [
        sys.executable, "-m", "tandem.cli", "train", "--model_name_or_path", tmp / "model", "--dataset_name", tmp / "data.jsonl",
        "--reward_funcs", f"{tmp / 'reward.py'}:digits", "--output_dir", out, "--max_steps", args.steps, "--save_steps", "0",
        "--num_generations", "8", "--per_device_train_batch_size", args.batch, "--max_completion_length", args.completion_length,
        "--learning_rate", "1e-4", "--disable_tqdm", "true", "--rollout_mode", "server", "--rollout_server_urls", url,
        "--async_generate", "true" if mode == "async" else "false", "--max_staleness", "1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"trainer failed:\n{proc.stderr[-3000:]}")
    m = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][args.warmup :]
    steps = [b["timestamp"] - a["timestamp"] for a, b in zip(m, m[1:])]
    return {
        "generate": statistics.median(x["time/generate"] for x in m),
        "train": statistics.median(x["time/train"] + x["time/weight_sync"] for x in m),
        "wait": statistics.median(x["time/wait_for_rollouts"] for x in m),
        "step": statistics.median(steps),
        "tokens_per_s": statistics.median(x["completion_tokens"] for x in m) / statistics.median(steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4, help="first steps left out of the medians")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64, help="completions per step")
    ap.add_argument("--completion-length", type=int, default=48)
    ap.add_argument("--size", default="small")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        subprocess.run([sys.executable, "-m", "tandem.cli", "init-model", tmp / "model", "--size", args.size], check=True, capture_output=True)
        write_jsonl(addition_rows(0), tmp / "data.jsonl")
        (tmp / "reward.py").write_text(REWARD)
        server, url = start_server(tmp / "model", "--threads", "1", prefix=pinned(1), env={"OMP_NUM_THREADS": "1"})
        try:
            results = {"sync": [], "async": []}
            for rep in range(args.repeats):
                for mode in ("sync", "async"):
                    results[mode].append(run_trainer(args, tmp, url, mode, rep))
        finally:
            server.terminate()
            server.wait(timeout=30)

    med = {mode: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for mode, runs in results.items()}
    s, a = med["sync"], med["async"]
    gen, train = s["generate"], s["train"]
    speedup = s["step"] / a["step"]
    ideal = (gen + train) / max(gen, train)
    print(f"pinning: {'taskset (trainer core 0, server core 1)' if pinned(0) else 'none (taskset missing)'}; "
          f"model {args.size}, {args.batch} completions x {args.completion_length} tokens per step")  # fmt: skip
    print(f"{'mode':<6} {'generate s':>11} {'train s':>8} {'wait s':>7} {'step s':>7} {'tokens/s':>9}")
    for mode in ("sync", "async"):
        r = med[mode]
        print(f"{mode:<6} {r['generate']:>11.3f} {r['train']:>8.3f} {r['wait']:>7.3f} {r['step']:>7.3f} {r['tokens_per_s']:>9.0f}")
    print(f"async speedup {speedup:.2f}x; ideal {ideal:.2f}x; overlap efficiency {speedup / ideal:.2f}")


if __name__ == "__main__":
    main()
