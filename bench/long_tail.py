"""Whole rounds against partial rollouts (token budgets) where completion lengths have a long tail.

    python bench/long_tail.py [--steps 12] [--warmup 3] [--repeats 2] [--stop-tokens 3]
    python bench/long_tail.py --size 0.5b --steps 6 --warmup 2 --repeats 1 --configs async "async k4" "partial k4"

The tail: a model at random init with `--stop-tokens` ordinary tokens listed beside <|im_end|>
as stop tokens in its generation_config. A random model's next token is close to uniform, so
each token ends the completion with probability about (stop tokens + 1) / vocabulary: lengths
are geometric, cut at max_completion_length 1,024, and a round's longest completion runs about
ln(completions) times its mean. The same seeds give the same lengths in every configuration.
  tiny (default)  `tandem init-model --size tiny` (0.1M parameters, 259 tokens; 3 stop tokens:
                  mean ~65), fp32, 8 prompts x 8 completions a round;
  0.5b            the Qwen2.5-0.5B shape of bench/scale.py (494M parameters, 151,936 tokens;
                  stop tokens for a mean of ~128), bf16 where the CPU computes it natively,
                  1 prompt x 8 completions a round (8 x 1,024).

A `tandem rollout` server (1 torch thread, core 1) and the trainer (core 0), configurations
alternating in each repeat:
  sync            whole rounds, generated when the trainer asks
  async           whole rounds, one round ahead (max_staleness 1, async_generate's default)
  async k4        whole rounds, up to 4 rounds ahead
  partial k4      token budgets: max_tokens_per_round 128 (--budget), max_staleness 4
Reported over the steps after the warm-up: completion tokens per second of wall time, seconds
per step, and the engine's occupancy (tokens kept / sequences x decode steps of its calls).
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
from scale import VOCAB, write_model
from tandem.trainer.setup import resolve_bf16
from tandem.demo import addition_rows, write_jsonl

CONFIGS = {
    "sync": ["--async_generate", "false"],
    "async": ["--async_generate", "true"],
    "async k4": ["--async_generate", "true", "--max_staleness", "4"],
    "partial k4": ["--async_generate", "true", "--max_staleness", "4"],  # and --max_tokens_per_round (--budget)
}
REWARD = "def digits(prompts, completions, **kw):\n    return [sum(ch.isdigit() for ch in c[-1]['content']) / max(1, len(c[-1]['content'])) for c in completions]\n"


def pinned(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if shutil.which("taskset") else []


def make_model(tmp: Path, size: str, stop_tokens: int) -> Path:
    model = tmp / "model"
    if size == "0.5b":
        write_model(model, size)
        stop_tokens = VOCAB // 128
    else:
        subprocess.run([sys.executable, "-m", "tandem.cli", "init-model", model, "--size", size], check=True, capture_output=True)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = max(2048, config["max_position_embeddings"])  # rotary: room for a prompt and 1,024 tokens
    (model / "config.json").write_text(json.dumps(config, indent=1))
    config = json.loads((model / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], *range(100, 100 + stop_tokens)]  # byte tokens of letters' region, far from digits
    (model / "generation_config.json").write_text(json.dumps(config, indent=1))
    return model


def run(args, tmp: Path, model: Path, url: str, name: str, rep: int) -> dict:
    out = tmp / f"{name.replace(' ', '-')}-{rep}"
    cmd = pinned(0) + [
        sys.executable, "-m", "tandem.cli", "train", "--model_name_or_path", model, "--dataset_name", tmp / "data.jsonl",
        "--reward_funcs", f"{tmp / 'reward.py'}:digits", "--output_dir", out, "--max_steps", args.steps, "--save_steps", "0",
        "--num_generations", "8", "--per_device_train_batch_size", 8 if args.size == "0.5b" else 64, "--max_completion_length", "1024",
        "--learning_rate", "1e-5", "--disable_tqdm", "true", "--rollout_mode", "server", "--rollout_server_urls", url, *CONFIGS[name],
        "--bf16", str(args.bf16).lower(), "--rollout_server_timeout", "600",
        *(["--max_tokens_per_round", args.budget] if name.startswith("partial") else []),
    ]  # fmt: skip
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    if proc.returncode:
        sys.exit(f"trainer ({name}) failed:\n{proc.stderr[-3000:]}")
    m = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = m[args.warmup :]
    seconds = measured[-1]["timestamp"] - m[args.warmup - 1]["timestamp"]
    occupancy = [x["engine/occupancy"] for x in measured if x.get("engine/occupancy") is not None]
    return {
        "tokens_per_s": sum(x["completion_tokens"] for x in measured) / seconds,
        "step": seconds / len(measured),
        "occupancy": statistics.mean(occupancy) if occupancy else float("nan"),
        "mean_length": statistics.mean(x["completions/mean_length"] for x in measured),
        "max_length": statistics.mean(x["completions/max_length"] for x in measured),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--stop-tokens", type=int, default=3)
    parser.add_argument("--budget", type=int, default=128, help="max_tokens_per_round of the partial runs")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small", "0.5b"], help="the model: tandem init-model's size, or 0.5b (bench/scale.py's)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = make_model(tmp, args.size, args.stop_tokens)
        write_jsonl(addition_rows(0), tmp / "data.jsonl")
        (tmp / "reward.py").write_text(REWARD)
        args.bf16 = args.size == "0.5b" and resolve_bf16(True)[1] is None  # bf16 where this CPU computes it natively
        server, url = start_server(model, "--threads", "1", "--dtype", "bfloat16" if args.bf16 else "float32", prefix=pinned(1), timeout=600)
        try:
            results: dict[str, list[dict]] = {name: [] for name in args.configs}
            for rep in range(args.repeats):
                for name in args.configs:
                    results[name].append(run(args, tmp, model, url, name, rep))
                    r = results[name][-1]
                    print(f"  {name:11s} repeat {rep}: {r['tokens_per_s']:7.0f} tokens/s, {r['step']:.2f} s/step, occupancy {r['occupancy']:.2f}", flush=True)
        finally:
            server.terminate()
            server.wait(timeout=30)
    base = statistics.median(r["tokens_per_s"] for r in results.get("async", results[args.configs[0]]))
    shape = "0.5B shape, 1 x 8" if args.size == "0.5b" else f"{args.size} model, 8 x 8"
    print(f"\n{args.steps} steps ({args.warmup} warm-up), {shape} completions of up to 1,024 tokens ({'bf16' if args.bf16 else 'fp32'}), "
          f"lengths geometric; medians of {args.repeats}")  # fmt: skip
    print(f"{'config':11s} {'tokens/s':>9s} {'vs async':>8s} {'s/step':>7s} {'occupancy':>9s} {'mean len':>8s} {'max len':>7s}")
    for name, rs in results.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        print(f"{name:11s} {tps:9.0f} {tps / base:7.2f}x {statistics.median(r['step'] for r in rs):7.2f} "
              f"{statistics.median(r['occupancy'] for r in rs):9.2f} {statistics.median(r['mean_length'] for r in rs):8.0f} "
              f"{statistics.median(r['max_length'] for r in rs):7.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
