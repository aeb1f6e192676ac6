"""Load on a rollout server: clients generating while the weights change every few seconds.

    python bench/server_load.py [--clients 16] [--seconds 30] [--push-every 2] [--size small]

Checks what must hold under load and prints it with the figures: every request answered 200;
every completion generated with weights that were live, of at least the version it asked for;
the server's memory flat. Prints requests/s, latency percentiles and the server's RSS.
"""

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import requests
import torch

from common import start_server  # bench/common.py
from tandem.init_model import init_model
from tandem.rollout.client import RolloutClient

PROMPT = [1, 120, 118, 104, 117, 13, 54, 46, 55]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--push-every", type=float, default=2.0)
    ap.add_argument("--size", default="small", choices=["tiny", "small", "medium"])
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model, _ = init_model(Path(tmp) / "model", size=args.size, seed=0)
        server, url = start_server(Path(tmp) / "model", "--threads", "1")
        committed = [0]  # the newest version made live: requests ask for it
        pushing = [0]  # the version being pushed: no completion may be newer
        results: list[tuple[int, float, list[int], int]] = []  # status, seconds, versions, min_version
        rss: list[float] = []
        stop = time.monotonic() + args.seconds

        def client(k: int) -> None:
            rng = random.Random(k)
            while time.monotonic() < stop:
                want = committed[0]
                body = {"prompts": [PROMPT, PROMPT[:5]], "n": 2, "seeds": [rng.getrandbits(32) for _ in range(4)],
                        "sampling": {"max_tokens": 8}, "min_version": want, "version_timeout": 10}  # fmt: skip
                t = time.perf_counter()
                r = requests.post(url + "/generate", json=body, timeout=60)
                seconds = time.perf_counter() - t
                versions = [c["version"] for c in r.json()["completions"]] if r.status_code == 200 else []
                if any(v > pushing[0] for v in versions):
                    versions.append(-1)  # a version that was not live yet: counted below
                results.append((r.status_code, seconds, versions, want))

        def pusher() -> None:
            push = RolloutClient([url], server_timeout=60)
            named = list(model.named_parameters())
            while time.monotonic() < stop - args.push_every:
                time.sleep(args.push_every)
                with torch.no_grad():
                    for _, p in named:
                        p.add_(torch.randn_like(p) * 1e-3)
                pushing[0] = committed[0] + 1
                push.push_weights(named, pushing[0])
                committed[0] = pushing[0]
            push.close()

        threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)] + [threading.Thread(target=pusher)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            rss.append(rss_mb(server.pid))
            time.sleep(1.0)
        server.terminate()
        server.wait(timeout=30)

    ok = [r for r in results if r[0] == 200]
    latencies = sorted(r[1] for r in ok)
    early = sum(1 for r in ok if -1 in r[2])
    stale = sum(1 for r in ok if any(0 <= v < r[3] for v in r[2]))
    print(f"{args.clients} clients, {args.seconds:.0f}s, a weight push every {args.push_every:g}s ({committed[0]} pushes), model {args.size}")
    print(f"requests {len(results)}, answered 200: {len(ok)}, other: {len(results) - len(ok)} {sorted({r[0] for r in results} - {200})}")
    print(f"requests/s {len(results) / args.seconds:.0f}; latency p50 {1e3 * statistics.median(latencies):.0f} ms, "
          f"p99 {1e3 * latencies[int(0.99 * (len(latencies) - 1))]:.0f} ms")  # fmt: skip
    print(f"completions with a version not yet live: {early}; older than asked for: {stale}")
    print(f"server RSS MB: start {rss[0]:.0f}, max {max(rss):.0f}, end {rss[-1]:.0f}")


if __name__ == "__main__":
    main()
