"""tandem against TRL's GRPOTrainer on the same machine, task, model and settings, at two shapes,
in fp32 and bf16, with each phase's share of the machine's own matmul roofline.

    python bench/vs_trl.py [--steps 20] [--seeds 0] [--shapes short long] [--bf16 auto|always|never] [--configs ...]

Creates bench/.venv-trl (torch 2.13.0 CPU, trl 1.16.0, and the same transformers, accelerate and
datasets as tandem) the first time; TRL is never a dependency of tandem.

Shapes (both: the demo's prompts and exact-match reward, the `small` model (3M parameters),
8 prompts x 8 generations per step, beta 0, loss dapo, temperature 1, constant learning rate):
  short  completions of at most 4 tokens, lr 1e-3, the model after the demo's warm-up;
  long   completions of at most 64 tokens, lr 1e-4, the model at random init: it rarely stops,
         so completions average about 56 tokens. Generation dominates, as in real runs.
Configurations, each with default settings as a new user runs them (no taskset, no thread
variables): TRL (its defaults: colocated transformers generation), tandem colocated, tandem with
a rollout server in sync mode, and in async mode (`max_staleness 1`). fp32, then bf16 (TRL's
--bf16; tandem's --bf16 true with the server in --dtype bfloat16) where the machine computes bf16
at least as fast as fp32 (--bf16 always runs it anyway).

Printed per configuration: seconds per step and completion tokens/s end to end (medians over the
steps after the first 3), and for tandem each phase's median seconds: generate, train and weight
sync, with generate and train as model FLOP/s (2 x matmul parameters per token generated or
prefilled, 6 x per token trained; attention left out) against the roofline: a 2048x2048 matmul
on every core, measured at start in the same dtype (512x512 where the dtype is emulated).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common import start_server
from tandem.data import encode_prompt, load_prompt_dataset
from tandem.demo import prepare

HERE = Path(__file__).resolve().parent
TRL_VENV = HERE / ".venv-trl"
TRL_PY = TRL_VENV / "bin" / "python"
SHAPES = {
    "short": {"max_completion_length": 4, "learning_rate": 1e-3, "warm": True},
    "long": {"max_completion_length": 64, "learning_rate": 1e-4, "warm": False},
}
BATCH, G = 64, 8
CONFIGS = ["trl", "tandem colocate", "tandem server sync", "tandem server async"]
# --configs may add "tandem colocate ckpt": colocated with gradient_checkpointing forced on (TRL's default)
SKIP = 3  # first steps left out of the timings (start-up)


def ensure_trl() -> None:
    if TRL_PY.exists():
        return
    print("creating bench/.venv-trl with trl 1.16.0 ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", TRL_VENV], check=True)
    pip = [TRL_PY, "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + ["trl==1.16.0", "transformers==5.23.0", "accelerate==1.15.0", "datasets==5.2.0"], check=True)


def roofline(dtype: torch.dtype) -> float:
    """FLOP/s of a large matmul on every core: 2048x2048, or 512x512 where that alone shows an
    emulated dtype (under 10 GFLOP/s, where one 2048 matmul would take a minute)."""
    rate = 0.0
    for size in (512, 2048):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b
        reps, t = 0, time.perf_counter()
        while reps < 3 or time.perf_counter() - t < 1.0:
            a @ b
            reps += 1
        rate = 2 * size**3 * reps / (time.perf_counter() - t)
        if rate < 10e9:
            break
    return rate


def model_facts(model: Path, data: Path) -> tuple[int, float]:
    """Parameters that take part in a matmul per token (every Linear, the LM head included even
    when tied to the embedding), and the mean prompt length in tokens."""
    lm = AutoModelForCausalLM.from_pretrained(model)
    matmul = sum(m.weight.numel() for m in lm.modules() if isinstance(m, torch.nn.Linear))
    tok = AutoTokenizer.from_pretrained(model)
    rows = load_prompt_dataset(str(data), "train", None)
    lengths = [len(encode_prompt(tok, r["prompt"], None, "error")) for r in rows]
    return matmul, statistics.mean(lengths)


def run(config: str, bf16: bool, shape: str, seed: int, args, tmp: Path, model: Path, data: Path) -> dict:
    s = SHAPES[shape]
    out = tmp / f"{shape}-{config.replace(' ', '-')}-{'bf16' if bf16 else 'fp32'}-{seed}"
    server = None
    if config == "trl":
        cmd = [TRL_PY, HERE / "trl_run.py", "--model", model, "--data", data, "--out", f"{out}.jsonl", "--steps", args.steps,
               "--seed", seed, "--batch", BATCH, "--num_generations", G, "--max_completion_length", s["max_completion_length"],
               "--learning_rate", s["learning_rate"], "--bf16", str(bf16).lower()]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "tandem.cli", "train", "--model_name_or_path", model, "--dataset_name", data,
               "--reward_funcs", "exact_match", "--output_dir", out, "--max_steps", args.steps, "--seed", seed,
               "--per_device_train_batch_size", BATCH, "--num_generations", G,
               "--max_completion_length", s["max_completion_length"], "--learning_rate", s["learning_rate"],
               "--lr_scheduler_type", "constant", "--beta", "0", "--loss_type", "dapo", "--bf16", str(bf16).lower(),
               "--save_steps", "0", "--disable_tqdm", "true"]  # fmt: skip
        if config.endswith("ckpt"):
            cmd += ["--gradient_checkpointing", "true"]
        if "server" in config:
            server, url = start_server(model, "--dtype", "bfloat16" if bf16 else "float32")
            cmd += ["--rollout_mode", "server", "--rollout_server_urls", url, "--async_generate", str("async" in config).lower()]
    try:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    if proc.returncode:
        sys.exit(f"{config} failed:\n{proc.stderr[-3000:]}")
    if config == "trl":
        steps = [json.loads(line) for line in Path(f"{out}.jsonl").read_text().splitlines()]
        tokens = [x["mean_length"] * BATCH for x in steps]
    else:
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        tokens = [x["completion_tokens"] for x in steps]
    times = [b["timestamp"] - a["timestamp"] for a, b in zip(steps[SKIP:], steps[SKIP + 1 :])]
    result = {
        "step_s": statistics.median(times),
        "tokens_per_s": sum(tokens[SKIP + 1 :]) / sum(times),
        "completion_tokens": statistics.median(tokens[SKIP + 1 :]),
        "final_reward": statistics.mean(x["reward"] for x in steps[-5:]),
    }
    if config != "trl":
        for phase in ("generate", "train", "weight_sync", "wait_for_rollouts"):
            result[phase] = statistics.median(x[f"time/{phase}"] for x in steps[SKIP + 1 :])
    return result


def report(shape: str, dtype: str, results: dict, matmul: int, prompt_tokens: float, peak: float) -> None:
    trl = statistics.median(r["tokens_per_s"] for r in results["trl"]) if "trl" in results else None  # --configs without trl: no ratio
    print(f"\n{shape} shape, {dtype} (roofline {peak / 1e9:.0f} GFLOP/s); medians over seeds")
    print(f"{'configuration':<20} {'s/step':>7} {'tokens/s':>9} {'vs TRL':>7} {'generate s':>11} {'gen %roof':>9} "
          f"{'train s':>8} {'train %roof':>11} {'sync s':>7} {'wait s':>7} {'reward':>7}")  # fmt: skip
    for config, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        ratio = f"{med['tokens_per_s'] / trl:>6.2f}x" if trl else f"{'':>7}"
        line = f"{config:<20} {med['step_s']:>7.3f} {med['tokens_per_s']:>9.0f} {ratio}"
        if config != "trl":
            prefill = BATCH // G * prompt_tokens  # each distinct prompt once (prefix sharing)
            tokens = prefill + med["completion_tokens"]
            gen = 2 * matmul * tokens / max(med["generate"], 1e-9) / peak
            train = 6 * matmul * tokens / max(med["train"], 1e-9) / peak
            line += (f" {med['generate']:>11.3f} {gen:>8.0%} {med['train']:>8.3f} {train:>10.0%} "
                     f"{med['weight_sync']:>7.3f} {med['wait_for_rollouts']:>7.3f}")  # fmt: skip
        else:
            line += f" {'':>11} {'':>9} {'':>8} {'':>11} {'':>7} {'':>7}"
        print(line + f" {statistics.mean(r['final_reward'] for r in runs):>7.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--bf16", default="auto", choices=["auto", "always", "never"])
    ap.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS + ["tandem colocate ckpt"])
    args = ap.parse_args()
    ensure_trl()
    peaks = {"fp32": roofline(torch.float32), "bf16": roofline(torch.bfloat16)}
    print(f"matmul roofline on {os.cpu_count()} cores: fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s", flush=True)
    dtypes = ["fp32"]
    if args.bf16 == "always" or (args.bf16 == "auto" and peaks["bf16"] >= peaks["fp32"]):
        dtypes.append("bf16")
    elif args.bf16 == "auto":
        print(f"bf16 left out: this CPU computes it {peaks['fp32'] / peaks['bf16']:.0f}x slower than fp32 (--bf16 always runs it)")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        for shape in args.shapes:
            for dtype in dtypes:
                results: dict[str, list[dict]] = {c: [] for c in args.configs}
                for seed in args.seeds:
                    task = tmp / f"task-{seed}"
                    if not task.exists():
                        prepare(task, seed=seed, size="small")
                        subprocess.run([sys.executable, "-m", "tandem.cli", "init-model", task / "random", "--size", "small",
                                        "--seed", str(seed)], check=True, capture_output=True)  # fmt: skip
                    model = task / ("model" if SHAPES[shape]["warm"] else "random")
                    for config in args.configs:  # alternate tools within each seed, so drift hits all of them
                        results[config].append(run(config, dtype == "bf16", shape, seed, args, tmp, model, task / "addition.jsonl"))
                        print(f"{shape} {dtype} seed {seed} {config}: {results[config][-1]}", flush=True)
                matmul, prompt_tokens = model_facts(model, task / "addition.jsonl")
                report(shape, dtype, results, matmul, prompt_tokens, peaks[dtype])


if __name__ == "__main__":
    main()
