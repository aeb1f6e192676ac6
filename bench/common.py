"""What the benchmarks share: a free loopback port and a `tandem rollout` process to measure against."""

import os
import socket
import subprocess
import sys
import time

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
