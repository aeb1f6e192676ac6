"""tandem against TRL's GRPOTrainer at the shape users train: a Qwen2.5-0.5B-shaped model (24
layers, hidden 896, 14 heads, 2 KV heads, vocabulary 151,936, tied embeddings; 494M parameters)
at random init, written by this script (no download).

    python bench/scale.py [--lengths 256 1024] [--steps 3] [--configs trl colocate server] [--size 0.5b|1.5b] [--bf16 auto|always|never|only]
                          [--trl-python PYTHON]

Each step: 2 prompts x 4 generations = 8 completions of exactly --lengths tokens (a random
model almost never ends one early), a reward of random noise (so every group has an advantage),
beta 0, fp32 (bf16 too where this CPU computes it faster: see the roofline line), with default
settings otherwise: TRL 1.16 with its own (gradient checkpointing on, colocated transformers
generation), tandem colocated, and tandem with a rollout server in sync mode (and on request
tandem colocated without gradient checkpointing). The configurations
alternate within each length, one process at a time.

Printed per configuration: peak RSS of the training process (and of the server), seconds per
step and completion tokens/s (medians over the steps after the first), and for tandem the split
into generate and train, each as model FLOP/s against the machine's matmul roofline (measured at
start), and generation against its memory-bandwidth limit: every decode step reads every weight
once, so tokens/s can be at most bandwidth / weight bytes x rows decoded together. The floor is
what fp32 AdamW training cannot avoid: weights, gradients and two moments, 16 bytes a parameter.
Creates bench/.venv-trl as bench/vs_trl.py does, unless --trl-python names a Python with TRL.

On a machine with a CUDA GPU everything runs there, as its users run it: TRL and tandem train on
the GPU, the server (server configs) runs with --device cuda on the same GPU, the roofline and
bandwidth are the GPU's, and the memory column is each trainer's peak GPU memory
(torch.cuda.max_memory_allocated) instead of its RSS. `server-async` is a server run in async
mode; server configs print the median seconds of a weight push. bench/gpu/check.sh runs this.
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
from transformers import Qwen2Config, Qwen2ForCausalLM

from common import free_port
from vs_trl import TRL_PY, ensure_trl, roofline
from tandem.init_model import build_tokenizer

HERE = Path(__file__).resolve().parent
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# ru_maxrss is in KiB on Linux; the figures are decimal GB, as the floor is. Runs A-G of
# docs/benchmarks.md divided it by 1e6, 2.4% under these.
KIB_TO_GB = 1024 / 1e9
# name -> (hidden_size, intermediate_size, layers, heads, kv_heads): Qwen2.5's published configs
SHAPES = {"0.5b": (896, 4864, 24, 14, 2), "1.5b": (1536, 8960, 28, 12, 2)}
VOCAB = 151_936
PROMPTS, G = 2, 4
REWARD = '''import random


def noise(completions, **kwargs):
    return [random.random() for _ in completions]
'''


def write_model(out: Path, size: str) -> int:
    """The shape at random init, with tandem's byte-level tokenizer (the model's vocabulary is the
    real one; ids past the tokenizer's decode to nothing). Returns the parameter count."""
    hidden, inter, layers, heads, kv = SHAPES[size]
    tok = build_tokenizer()
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def bandwidth() -> float:
    """Bytes/s of a large copy (read + write) on DEVICE, the bound a decode step's weight reads live under."""
    a = torch.empty((2048 if DEVICE.type == "cuda" else 256) << 20, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    return 2 * a.numel() / timed(lambda: b.copy_(a))


def matmul_rate(dtype: torch.dtype) -> float:
    """FLOP/s of a large matmul on DEVICE (on the CPU: vs_trl.roofline)."""
    if DEVICE.type != "cuda":
        return roofline(dtype)
    a, b = (torch.randn(8192, 8192, dtype=dtype, device=DEVICE) for _ in range(2))
    return 2 * 8192**3 / timed(lambda: a @ b)


def timed(fn) -> float:
    """Seconds of one fn() on DEVICE, averaged over at least a second of calls after one warm-up."""
    sync = torch.cuda.synchronize if DEVICE.type == "cuda" else (lambda: None)
    fn()
    sync()
    reps, t = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - t < 1.0:
        fn()
        sync()
        reps += 1
    return (time.perf_counter() - t) / reps


def run_measured(cmd: list, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    """Run `cmd`; its exit status, output and peak RSS in GB (its own, from wait4)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=err, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        out.seek(0), err.seek(0)
        done = subprocess.CompletedProcess(proc.args, os.waitstatus_to_exitcode(status), out.read(), err.read())
    return done, usage.ru_maxrss * KIB_TO_GB


def run(config: str, length: int, bf16: bool, args, tmp: Path, model: Path, data: Path, reward: Path) -> dict:
    out = tmp / f"{config}-{length}-{'bf16' if bf16 else 'fp32'}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    server = None
    if config == "trl":
        cmd = [args.trl_python, HERE / "trl_run.py", "--model", model, "--data", data, "--out", f"{out}.jsonl", "--steps", args.steps,
               "--seed", 0, "--batch", PROMPTS * G, "--num_generations", G, "--max_completion_length", length,
               "--learning_rate", 1e-6, "--bf16", str(bf16).lower(), "--reward", f"{reward}:noise"]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "tandem.cli", "train", "--model_name_or_path", model, "--dataset_name", data,
               "--reward_funcs", f"{reward}:noise", "--output_dir", out, "--max_steps", args.steps, "--seed", 0,
               "--per_device_train_batch_size", PROMPTS * G, "--num_generations", G, "--max_completion_length", length,
               "--learning_rate", 1e-6, "--lr_scheduler_type", "constant", "--beta", 0, "--loss_type", "dapo",
               "--bf16", str(bf16).lower(), "--save_steps", 0, "--disable_tqdm", "true"]  # fmt: skip
        if config == "colocate-no-ckpt":
            cmd += ["--gradient_checkpointing", "false"]
        if config.startswith("server"):
            port = free_port()
            server = subprocess.Popen([sys.executable, "-m", "tandem.cli", "rollout", "--model", model, "--port", str(port), "--dtype",
                                       "bfloat16" if bf16 else "float32", "--device", str(DEVICE)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            cmd += ["--rollout_mode", "server", "--rollout_server_urls", f"http://127.0.0.1:{port}", "--async_generate", str(config == "server-async").lower(),
                    "--rollout_server_timeout", 600]  # fmt: skip
    try:
        proc, rss = run_measured(cmd, env)
    finally:
        server_rss = None
        if server is not None:
            server.terminate()
            _, _, usage = os.wait4(server.pid, 0)
            server_rss = usage.ru_maxrss * KIB_TO_GB
    if proc.returncode:
        return {"failed": proc.stderr[-1500:], "peak_rss_gb": rss}
    if config == "trl":
        steps = [json.loads(line) for line in Path(f"{out}.jsonl").read_text().splitlines()]
        tokens = [x["mean_length"] * PROMPTS * G for x in steps]
    else:
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        tokens = [x["completion_tokens"] for x in steps]
    times = [b["timestamp"] - a["timestamp"] for a, b in zip(steps, steps[1:])]
    result = {"peak_rss_gb": rss, "server_rss_gb": server_rss, "step_s": statistics.median(times),
              "tokens_per_s": sum(tokens[1:]) / sum(times), "completion_tokens": statistics.median(tokens[1:])}  # fmt: skip
    if DEVICE.type == "cuda":
        result["gpu_peak_gb"] = max(x["gpu_peak_gb" if config == "trl" else "memory/peak_gb/max"] for x in steps)
    if config != "trl":
        for phase in ("generate", "train", "weight_sync"):
            result[phase] = statistics.median(x[f"time/{phase}"] for x in steps[1:])
    return result


def report(length: int, dtype: str, results: dict, params: int, peak: float, bytes_per_s: float) -> None:
    floor = 16 * params / 1e9
    # On a GPU each trainer's peak GPU memory (GiB, torch.cuda.max_memory_allocated), else its peak RSS (GB).
    memory, label = ("gpu_peak_gb", "peak GPU GiB") if DEVICE.type == "cuda" else ("peak_rss_gb", "peak RSS GB")
    print(f"\n8 x {length} tokens, {dtype}, on {DEVICE.type}; floor (fp32 AdamW state) {floor:.1f} GB; roofline {peak / 1e9:.0f} GFLOP/s; "
          f"copy bandwidth {bytes_per_s / 1e9:.1f} GB/s")  # fmt: skip
    print(f"{'configuration':<16} {label:>12} {'x floor':>7} {'server GB':>9} {'s/step':>7} {'tokens/s':>8} {'vs TRL':>7} "
          f"{'generate s':>10} {'gen %roof':>9} {'gen %bw':>7} {'train s':>8} {'train %roof':>11} {'push s':>7}")  # fmt: skip
    trl = results.get("trl", {}).get("tokens_per_s")
    weight_bytes = params * (2 if dtype == "bf16" else 4)
    for config, r in results.items():
        if "failed" in r:
            print(f"{config:<16} {r['peak_rss_gb']:>12.1f} failed: {r['failed'].strip().splitlines()[-1]}")
            continue
        vs_trl = f"{r['tokens_per_s'] / trl:.2f}x" if trl else "-"  # no TRL run to compare with
        line = (f"{config:<16} {r[memory]:>12.1f} {r[memory] / floor:>6.2f}x {r['server_rss_gb'] or 0:>9.1f} "
                f"{r['step_s']:>7.1f} {r['tokens_per_s']:>8.1f} {vs_trl:>7}")  # fmt: skip
        if config != "trl":
            tokens = r["completion_tokens"]
            gen = 2 * params * tokens / r["generate"] / peak
            steps = tokens / PROMPTS / G  # decode steps: one token of every row each
            at_bandwidth = steps * weight_bytes / bytes_per_s  # seconds if each step only read the weights
            train = 6 * params * tokens / r["train"] / peak
            line += f" {r['generate']:>10.1f} {gen:>8.0%} {at_bandwidth / r['generate']:>6.0%} {r['train']:>8.1f} {train:>10.0%}"
            if config.startswith("server"):
                line += f" {r['weight_sync']:>7.2f}"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run; the first is left out of the timings")
    ap.add_argument("--configs", nargs="+", default=["trl", "colocate", "server"], choices=["trl", "colocate", "colocate-no-ckpt", "server", "server-async"],
                    help="colocate-no-ckpt: colocated with gradient_checkpointing false; server: a rollout server in sync mode; server-async: in async mode")
    ap.add_argument("--trl-python", default=str(TRL_PY), help="a Python that has TRL 1.16 (default: bench/.venv-trl's, made on first use)")
    ap.add_argument("--size", default="0.5b", choices=list(SHAPES))
    ap.add_argument("--bf16", default="auto", choices=["auto", "always", "never", "only"],
                    help="auto: bf16 rows too where this CPU computes bf16 faster than fp32; always: both dtypes; only: bf16 rows alone")
    args = ap.parse_args()
    if "trl" in args.configs and args.trl_python == str(TRL_PY):
        ensure_trl()
    flags = " ".join(f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f in Path("/proc/cpuinfo").read_text())
    peaks = {"fp32": matmul_rate(torch.float32), "bf16": matmul_rate(torch.bfloat16)}
    bytes_per_s = bandwidth()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()  # the measurements' memory back to the GPU, for the runs
    where = torch.cuda.get_device_name() if DEVICE.type == "cuda" else f"{os.cpu_count()} cores ({flags})"
    print(f"{where}; matmul roofline fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s", flush=True)
    dtypes = [] if args.bf16 == "only" else ["fp32"]
    if args.bf16 in ("always", "only") or (args.bf16 == "auto" and peaks["bf16"] > peaks["fp32"]):
        dtypes.append("bf16")
    elif args.bf16 == "auto":
        print(f"bf16 left out: this CPU computes it {peaks['fp32'] / peaks['bf16']:.0f}x slower than fp32 (--bf16 always runs it)")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        params = write_model(tmp / "model", args.size)
        data = tmp / "prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Write a long story about the number {i}."}]}) + "\n"
                                for i in range(64)))  # fmt: skip
        reward = tmp / "noise.py"
        reward.write_text(REWARD)
        print(f"{args.size} shape: {params / 1e6:.0f}M parameters", flush=True)
        for length in args.lengths:
            for dtype in dtypes:
                results = {}
                for config in args.configs:
                    results[config] = run(config, length, dtype == "bf16", args, tmp, tmp / "model", data, reward)
                    print(f"{length} {dtype} {config}: {results[config]}", flush=True)
                report(length, dtype, results, params, peaks[dtype], bytes_per_s)


if __name__ == "__main__":
    main()
