"""What the benchmarks share: a free loopback port, a `tandem rollout` process to measure against,
and a timed `tandem train` run against it."""

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model, *extra: str, prefix: list[str] = (), env: dict | None = None, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """`tandem rollout` on a free loopback port, once /health says ready; (process, url)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "tandem.cli", "rollout", "--model", str(model), "--port", str(port), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})},
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        try:
            if requests.get(url + "/health", timeout=1).json()["status"] == "ready":
                return proc, url
        except requests.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"the rollout server did not start (exit code {proc.poll()})")
        time.sleep(0.3)


def timed_server_run(url: str, model: Path, data: Path, out: Path, mode: str, steps: int, warmup: int, *extra: str,
                     env: dict | None = None) -> tuple[float, float, list[dict]]:
    """`tandem train` against the server at `url` at the generation-heavy shape: 8 prompts x 8
    completions of up to 64 tokens, exact_match, lr 1e-4, sync or async. Returns the median
    seconds per step and completion tokens per second after the first `warmup` steps, and those
    steps' metrics."""  # fmt: skip
    cmd = [sys.executable, "-m", "tandem.cli", "train", "--model_name_or_path", model, "--dataset_name", data,
           "--output_dir", out, "--reward_funcs", "exact_match", "--num_generations", "8", "--per_device_train_batch_size", "64",
           "--max_completion_length", "64", "--max_steps", steps, "--learning_rate", "1e-4", "--save_steps", "0",
           "--disable_tqdm", "true", "--rollout_mode", "server", "--rollout_server_urls", url,
           "--async_generate", "true" if mode == "async" else "false", *extra]  # fmt: skip
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"trainer failed:\n{proc.stderr[-3000:]}")
    m = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][warmup:]
    step = statistics.median(b["timestamp"] - a["timestamp"] for a, b in zip(m, m[1:]))
    return step, statistics.median(x["completion_tokens"] for x in m) / step, m
