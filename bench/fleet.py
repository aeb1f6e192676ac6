"""A fleet of rollout servers on this machine: completion tokens/s of one replica and of two (each
pinned to a core of its own with taskset, one engine thread each), then the same two with one
made a straggler, under each balance of `--rollout_balance` (`speed`, the default; `even`, tandem's
split before fleets), alternating call by call in one run.

    python bench/fleet.py [--size small] [--prompts 32] [--max-tokens 128] [--calls 6] [--engine vllm]

The straggler is produced by this script: a thread stops that replica's processes for half of
every 100 ms (SIGSTOP, then SIGCONT), so it runs at half speed whatever it does. With more
replicas than cores (--replicas 3 on two), none is pinned: each runs in a CPU cgroup of its own
that caps it at cores / replicas of a core (cpu.cfs_quota_us, or cpu.max where the machine has
cgroup v2; needs root), so each runs at a known speed, as on machines of equal size, and the
straggler's cap is half that. The first two calls of each client in each phase learn the
replicas' times and are not counted.
"""

import argparse
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from common import start_server  # bench/common.py
from tandem.init_model import init_model
from tandem.rollout.client import RolloutClient
from tandem.rollout.fleet import BALANCES
from tandem.rollout.types import SamplingParams


def family(pid: int) -> list[int]:
    """`pid` and every process under it (a vLLM server's engine core and workers)."""
    pids = [pid]
    for p in pids:
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                pids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return pids


def signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def throttle(pid: int, stop: threading.Event, period: float = 0.1) -> None:
    """Half speed: the process and those under it stopped for the first half of every period."""
    pids = family(pid)
    while not stop.is_set():
        signal_all(pids, signal.SIGSTOP)
        time.sleep(period / 2)
        signal_all(pids, signal.SIGCONT)
        time.sleep(period / 2)


class CpuCap:
    """A CPU cgroup that holds a process to `cores` of CPU time (over periods of 100 ms)."""

    def __init__(self, name: str):
        v1 = Path("/sys/fs/cgroup/cpu")
        self.dir = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / name
        self.dir.mkdir(exist_ok=True)

    def set(self, cores: float) -> None:
        quota = int(cores * 100_000)
        if (self.dir / "cpu.max").exists():  # cgroup v2
            (self.dir / "cpu.max").write_text(f"{quota} 100000")
        else:
            (self.dir / "cpu.cfs_period_us").write_text("100000")
            (self.dir / "cpu.cfs_quota_us").write_text(str(quota))

    def hold(self, pid: int) -> None:
        (self.dir / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        self.dir.rmdir()  # its processes are gone by then


def tokens_per_second(client: RolloutClient, prompts, seeds, params) -> float:
    start = time.perf_counter()
    out = client.generate(prompts, params, seeds)
    return sum(len(c.token_ids) for c in out) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=["tiny", "small", "medium"], help="model made by tandem init-model (random init)")
    ap.add_argument("--prompts", type=int, default=32, help="completions per call")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--calls", type=int, default=8, help="calls per figure")
    ap.add_argument("--replicas", type=int, default=min(os.cpu_count() or 1, 3),
                    help="replicas, one core each; more than the cores: each capped at cores / replicas by a cgroup (root)")
    ap.add_argument("--engine", default="transformers", choices=["transformers", "vllm"],
                    help="the servers' engine (vllm: run this script with .venv-vllm's python; eager mode, as the tests run it)")
    ap.add_argument("--cap", type=float, help="with more replicas than cores: each replica's cap in cores (default cores / replicas)")
    args = ap.parse_args()
    k, cores = args.replicas, os.cpu_count() or 1
    capped = k > cores
    cap_cores = args.cap or cores / k
    prompts = [[1, 40 + i % 50, 60, 70, 80] for i in range(args.prompts)]
    seeds = list(range(args.prompts))
    params = SamplingParams(max_tokens=args.max_tokens)
    engine = ("--engine", "vllm", "--enforce-eager") if args.engine == "vllm" else ()

    with tempfile.TemporaryDirectory() as tmp:
        init_model(Path(tmp) / "model", size=args.size, seed=0)
        if capped:
            caps = [CpuCap(f"tandem-fleet-{os.getpid()}-{i}") for i in range(k)]
            for cap in caps:
                cap.set(cap_cores)
            servers = [start_server(Path(tmp) / "model", "--threads", "1", *engine, timeout=600) for _ in range(k)]
            for cap, (proc, _) in zip(caps, servers):
                for pid in family(proc.pid):  # a vLLM server's engine core and workers too
                    cap.hold(pid)
        else:
            servers = [start_server(Path(tmp) / "model", "--threads", "1", *engine, prefix=["taskset", "-c", str(i)], timeout=600) for i in range(k)]
        urls = [url for _, url in servers]
        try:
            clients = {name: RolloutClient(urls, balance=name) for name in BALANCES}
            one = RolloutClient(urls[:1])
            for c in (one, *clients.values()):
                c.wait_until_ready()
            tokens_per_second(one, prompts, seeds, params)  # warm-up

            def alternate(names) -> dict[str, float]:
                """Median tokens/s of each client over the calls, one call of each in turn."""
                got: dict[str, list[float]] = {n: [] for n in names}
                for _ in range(2):  # the speed shares learn the replicas' times: not counted
                    for name in names:
                        tokens_per_second(clients.get(name, one), prompts, seeds, params)
                for _ in range(args.calls):
                    for name in names:
                        got[name].append(tokens_per_second(clients.get(name, one), prompts, seeds, params))
                return {n: sorted(v)[len(v) // 2] for n, v in got.items()}

            even_fleet = alternate(["one", *clients])
            stop = threading.Event()
            if capped:
                caps[-1].set(cap_cores / 2)
            else:
                threading.Thread(target=throttle, args=(servers[-1][0].pid, stop), daemon=True).start()
            try:
                straggler = alternate(list(clients))
            finally:
                stop.set()
                time.sleep(0.2)
                signal_all(family(servers[-1][0].pid), signal.SIGCONT)
            each = f"capped at {cap_cores:.2f} of a core" if capped else "one core"
            print(f"model {args.size}, {args.prompts} completions of up to {args.max_tokens} tokens a call, median of {args.calls} calls; "
                  f"{k} replicas, {each} and one thread each; completion tokens/s")  # fmt: skip
            print(f"| fleet | {' | '.join(clients)} |\n|---|{'---|' * len(clients)}")
            print(f"| 1 replica | {even_fleet['one']:.0f} |{' |' * (len(clients) - 1)}")
            print(f"| {k} replicas | {' | '.join(f'{even_fleet[n]:.0f}' for n in clients)} |")
            print(f"| {k} replicas, one at half speed | {' | '.join(f'{straggler[n]:.0f}' for n in clients)} |")
            for name in clients:
                print(f"{name}: the straggler keeps {straggler[name] / even_fleet[name]:.0%} of the even fleet's tokens/s")
            timed = clients["speed"].fleet.balance
            fits = ", ".join(f"replica {i}: a {fit[0] * 1e3:.2f} ms, b {fit[1] * 1e3:.3f} ms" for i, u in enumerate(urls) if (fit := timed.fit(u)))
            print(f"speed shares' fits of a step's seconds, a + b * rows: {fits}; last shares {[len(p) for _, p in clients['speed'].fleet.plan(prompts, seeds)]}")
        finally:
            for proc, _ in servers:
                proc.kill()
                proc.wait()
            for cap in caps if capped else ():
                cap.remove()


if __name__ == "__main__":
    main()
