"""tandem against TRL's GRPOTrainer on the same machine, task, model and hyperparameters.

    python bench/vs_trl.py [--steps 30] [--seeds 0 1 2]

Creates bench/.venv-trl (torch 2.13.0 CPU, trl 1.16.0, and the same transformers, accelerate and
datasets as tandem) the first time; TRL is never a dependency of tandem. The task is the demo's
(single-digit addition, exact-match reward) on the `small` model (3M parameters) after the
demo's supervised warm-up. Both tools use: 8 prompts x 8 generations per step, completions of at
most 4 tokens, learning rate 1e-3 (constant), beta 0, loss dapo, temperature 1, bf16 (TRL's
default; tandem is given --bf16 true). TRL runs with its defaults otherwise (colocated
transformers generation). Runs alternate between configurations, seed by seed. Printed per
configuration: completion tokens/s end to end and seconds per step (medians over the steps after
the first 3), peak RSS (trainer plus server), the mean reward over the last 10 steps averaged
over seeds, and ratios against TRL.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from tandem.demo import prepare

HERE = Path(__file__).resolve().parent
TRL_VENV = HERE / ".venv-trl"
TRL_PY = TRL_VENV / "bin" / "python"
COMMON = {"batch": 64, "num_generations": 8, "max_completion_length": 4, "learning_rate": 1e-3}
CONFIGS = ["trl", "tandem colocate sync", "tandem server sync", "tandem server async"]
SKIP = 3  # first steps left out of the timings (start-up)


def ensure_trl() -> None:
    if TRL_PY.exists():
        return
    print("creating bench/.venv-trl with trl 1.16.0 ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", TRL_VENV], check=True)
    pip = [TRL_PY, "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + ["trl==1.16.0", "transformers==5.23.0", "accelerate==1.15.0", "datasets==5.2.0"], check=True)


def timed(cmd: list, rss_file: Path) -> list:
    """cmd under GNU time, which writes the peak RSS (KiB) to rss_file."""
    return ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *map(str, cmd)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_kib(pid: int) -> int:
    """VmHWM: the peak resident set of a live process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def start_server(model: Path, pinned: bool):
    """Async overlaps the two processes: each gets its own core and one thread, or they thrash."""
    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "rollout", "--model", str(model), "--port", str(port)]
    if pinned:
        cmd = ["taskset", "-c", "1", *cmd, "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/health", timeout=1).json()["status"] == "ready":
                return proc, url
        except requests.ConnectionError:
            time.sleep(0.3)
    sys.exit("the rollout server did not start")


def run(config: str, seed: int, args, tmp: Path, model: Path, data: Path) -> dict:
    out = tmp / f"{config.replace(' ', '-')}-{seed}"
    rss = tmp / f"{out.name}.rss"
    server = None
    if config == "trl":
        cmd = [TRL_PY, HERE / "trl_run.py", "--model", model, "--data", data, "--out", f"{out}.jsonl", "--steps", args.steps,
               "--seed", seed, *[x for k, v in COMMON.items() for x in (f"--{k}", v)]]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "tandem.cli", "train", "--model_name_or_path", model, "--dataset_name", data,
               "--reward_funcs", "exact_match", "--output_dir", out, "--max_steps", args.steps, "--seed", seed,
               "--per_device_train_batch_size", COMMON["batch"], "--num_generations", COMMON["num_generations"],
               "--max_completion_length", COMMON["max_completion_length"], "--learning_rate", COMMON["learning_rate"],
               "--lr_scheduler_type", "constant", "--beta", "0", "--loss_type", "dapo", "--bf16", "true",
               "--save_steps", "0", "--disable_tqdm", "true"]  # fmt: skip
        if "server" in config:
            server, url = start_server(model, pinned="async" in config)
            cmd += ["--rollout_mode", "server", "--rollout_server_urls", url]
        if "async" in config:
            cmd = ["taskset", "-c", "0", *cmd, "--async_generate", "true", "--max_staleness", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **({"OMP_NUM_THREADS": "1"} if "async" in config else {})}
    server_kib = 0
    try:
        proc = subprocess.run(timed(cmd, rss), capture_output=True, text=True, env=env)
    finally:
        if server is not None:
            server_kib = peak_rss_kib(server.pid)
            server.terminate()
            server.wait(timeout=30)
    if proc.returncode:
        sys.exit(f"{config} failed:\n{proc.stderr[-3000:]}")
    if config == "trl":
        steps = [json.loads(line) for line in Path(f"{out}.jsonl").read_text().splitlines()]
        tokens = [s["mean_length"] * COMMON["batch"] for s in steps]
    else:
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        tokens = [s["completion_tokens"] for s in steps]
    times = [b["timestamp"] - a["timestamp"] for a, b in zip(steps[SKIP:], steps[SKIP + 1 :])]
    peak = int(rss.read_text().split()[-1]) + server_kib
    return {
        "step_s": statistics.median(times),
        "tokens_per_s": sum(tokens[SKIP + 1 :]) / sum(times),
        "rss_mib": peak / 1024,
        "final_reward": statistics.mean(s["reward"] for s in steps[-10:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    ensure_trl()
    results: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        for seed in args.seeds:
            model, data = prepare(tmp / f"task-{seed}", seed=seed, size="small")
            for config in CONFIGS:  # alternate tools within each seed, so drift hits all of them
                results[config].append(run(config, seed, args, tmp, model, data))
                print(f"seed {seed} {config}: {results[config][-1]}", flush=True)
    trl = {k: statistics.median(r[k] for r in results["trl"]) for k in results["trl"][0]}
    print(f"\n{len(args.seeds)} seeds x {args.steps} steps; medians over seeds (reward: mean)")
    print(f"{'configuration':<22} {'tokens/s':>9} {'s/step':>7} {'peak RSS MiB':>13} {'final reward':>13} {'tokens/s vs TRL':>16}")
    for config, runs in results.items():
        tps = statistics.median(r["tokens_per_s"] for r in runs)
        print(f"{config:<22} {tps:>9.0f} {statistics.median(r['step_s'] for r in runs):>7.3f} "
              f"{statistics.median(r['rss_mib'] for r in runs):>13.0f} {statistics.mean(r['final_reward'] for r in runs):>13.3f} "
              f"{tps / trl['tokens_per_s']:>15.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
