"""Weight-sync throughput from a trainer process to a `tandem rollout` server on loopback.

    python bench/weight_sync.py [--size 0.5b|tiny] [--repeats 3] [--transports http shm] [--device cuda --dtype bfloat16 --transports cuda_ipc shm http]
    python bench/weight_sync.py --delta [--dtypes bfloat16 float32]
    python bench/weight_sync.py --replicas 3

Builds a randomly initialised model of Qwen2-0.5B's shape (494M parameters, fp32), starts a real
server process on it, and pushes the weights with each transport as a versioned update
(begin, chunks, commit), timing the whole push. Prints GB/s (10^9 bytes per second of fp32
weights moved and made live). The last push of each transport is checked by fingerprint.
--device cuda: the trainer's weights and the server (--device cuda) on this machine's GPU, where
`cuda_ipc` is a transport too; prints the GPU memory the server took (free memory before it
started, less after the pushes). --dtype: the server's (float32 by default).

--delta: delta weight updates (delta_weight_updates) against whole ones, for a server of each
--dtypes. Between pushes the model takes one AdamW step (lr 1e-6, tandem's default learning
rate) on random gradients: Adam's first steps move every weight by about the learning rate, as
in a run's first steps. Whole updates: --repeats pushes over HTTP, each after a step; then a
delta client's first push (whole: the base) and --repeats deltas, each after a step. Prints
per push the bytes sent and the seconds, the fraction of the server dtype's words that changed,
and whether the server's fingerprint equals the trainer's weights in its dtype.

--replicas N: N bf16 servers (one engine thread each) as one fleet. Pushes to the first alone
and to all N, in two alternating blocks of --warmup + --repeats pushes each, over the default
transport (shared memory here); prints the median seconds of the pushes past each block's
first --warmup, and their ratio, then every push: blocks, as a run pushes to the same servers
at every step (pushes alternating one by one put every slow push on one side, docs/benchmarks.md),
and every push printed, as on this VM writing a fresh gigabyte of shared memory sometimes takes
up to 5 s instead of half a second.
"""

import argparse
import statistics
import tempfile
import time

import requests
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from common import start_server  # bench/common.py
from tandem.init_model import build_tokenizer
from tandem.rollout.client import RolloutClient
from tandem.rollout.weights import fingerprint

SHAPES = {
    # Qwen2-0.5B: hidden 896, 24 layers, 14 heads (2 KV), MLP 4864, vocabulary 151936, tied embeddings
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
    "tiny": dict(vocab_size=259, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.5b", choices=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transports", nargs="+", default=["http", "shm"], help="of http, shm, cuda_ipc")
    ap.add_argument("--device", default="cpu", help="where the trainer's weights and the server are: cpu or cuda")
    ap.add_argument("--dtype", default="float32", help="the server's dtype")
    ap.add_argument("--delta", action="store_true", help="delta weight updates against whole ones")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="with --delta: the servers' dtypes")
    ap.add_argument("--replicas", type=int, default=0, help="pushes to one server against pushes to this many")
    ap.add_argument("--warmup", type=int, default=1, help="with --replicas: pushes at the start of each block not counted")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, max_position_embeddings=2048, **SHAPES[args.size]))
    named = list(model.named_parameters())
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    print(f"model: {args.size}, {sum(t.numel() for _, t in named) / 1e6:.0f}M parameters, {nbytes / 1e9:.2f} GB in fp32")
    if args.delta:
        return deltas(model, args.dtypes, args.repeats)
    if args.replicas:
        return fleet_pushes(model, args.replicas, args.repeats, args.warmup)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        build_tokenizer().save_pretrained(tmp)
        cuda = args.device.startswith("cuda")
        named = list(model.to(args.device).named_parameters())
        free, mine = (torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()) if cuda else (0, 0)
        server, url = start_server(tmp, "--device", args.device, "--dtype", args.dtype, timeout=300)
        want = fingerprint((n, t.to(getattr(torch, args.dtype))) for n, t in named)
        try:
            client = RolloutClient([url], server_timeout=300)
            version = 0
            rows = []
            for transport in args.transports:
                client.transport = transport
                times = []
                for _ in range(args.repeats):
                    version += 1
                    t = time.perf_counter()
                    client.push_weights(named, version)
                    times.append(time.perf_counter() - t)
                served = requests.get(url + "/weights/fingerprint", timeout=300).json()
                ok = served["fingerprint"] == want and served["version"] == version
                best, median = min(times), sorted(times)[len(times) // 2]
                rows.append((transport, median, nbytes / median / 1e9, nbytes / best / 1e9, ok))
            client.close()
            if cuda:
                print(f"the server on {args.device} took {(free - torch.cuda.mem_get_info()[0] - (torch.cuda.memory_reserved() - mine)) / 2**30:.1f} GiB of GPU memory "
                      f"(its {args.dtype} weights {sum(t.numel() for _, t in named) * getattr(torch, args.dtype).itemsize / 2**30:.1f} GiB, "
                      "with its CUDA context, caches and a push's staging)")  # fmt: skip
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"{args.device}, a {args.dtype} server")
    print(f"{'transport':<10} {'median s':>9} {'GB/s (median)':>14} {'GB/s (best)':>12} {'fingerprint':>12}")
    for transport, median, gbs, best, ok in rows:
        print(f"{transport:<10} {median:>9.3f} {gbs:>14.2f} {best:>12.2f} {'match' if ok else 'MISMATCH':>12}")


def fleet_pushes(model, replicas: int, repeats: int, warmup: int) -> None:
    named = list(model.named_parameters())
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        build_tokenizer().save_pretrained(tmp)
        servers = [start_server(tmp, "--dtype", "bfloat16", "--threads", "1", timeout=300) for _ in range(replicas)]
        urls = [url for _, url in servers]
        try:
            one, fleet = RolloutClient(urls[:1], server_timeout=300), RolloutClient(urls, server_timeout=300)
            times: dict[str, list[float]] = {"one": [], "all": []}
            warm: dict[str, list[float]] = {"one": [], "all": []}
            version = 0
            for _ in range(2):  # blocks of each, alternating
                for name, client in (("one", one), ("all", fleet)):
                    for i in range(warmup + repeats):
                        version += 1
                        t = time.perf_counter()
                        client.push_weights(named, version, force=True)  # force: the first server takes versions of both clients
                        (warm if i < warmup else times)[name].append(time.perf_counter() - t)
            served = {requests.get(u + "/weights/fingerprint", timeout=300).json()["fingerprint"] for u in urls}
            mine = fingerprint([(n, t.to(torch.bfloat16)) for n, t in named])
        finally:
            for proc, _ in servers:
                proc.terminate()
                proc.wait(timeout=30)
    one_s, all_s = (statistics.median(v) for v in times.values())
    print(f"bf16 servers; two blocks of {warmup} + {repeats} pushes to each, alternating; median seconds a push (every replica made live)")
    print(f"the first {warmup} of each block, not counted: 1 replica {[round(t, 2) for t in warm['one']]}; {replicas} replicas {[round(t, 2) for t in warm['all']]}")
    print(f"1 replica: {one_s:.2f} s; {replicas} replicas: {all_s:.2f} s ({all_s / one_s:.2f}x); fingerprints {'match' if served == {mine} else 'MISMATCH'}")
    print(f"each push, in order: 1 replica {[round(t, 2) for t in times['one']]}; {replicas} replicas {[round(t, 2) for t in times['all']]}")


def deltas(model, dtypes: list[str], repeats: int) -> None:
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step() -> float:
        """One optimizer step on random gradients; the fraction of words that changed in `dtype`."""
        before = [p.detach().to(dtype, copy=True) for p in model.parameters()]
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        changed = sum(int((b != p.detach().to(dtype)).sum()) for b, p in zip(before, model.parameters()))
        return changed / sum(p.numel() for p in model.parameters())

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        build_tokenizer().save_pretrained(tmp)
        for name in dtypes:
            dtype = getattr(torch, name)
            server, url = start_server(tmp, "--dtype", name, timeout=300)
            try:
                version = 0
                for delta in (False, True):
                    client = RolloutClient([url], server_timeout=300, transport="http", delta=delta)
                    for r in range(repeats + delta):
                        changed = step()
                        version += 1
                        t = time.perf_counter()
                        client.push_weights(named, version)
                        seconds = time.perf_counter() - t
                        served = requests.get(url + "/weights/fingerprint", timeout=300).json()
                        mine = fingerprint((n, p.to(dtype)) for n, p in named)
                        kind = "delta" if delta and r > 0 else "whole"
                        print(f"server {name:8s} {kind}: {client.push_bytes / 1e6:9.2f} MB in {seconds:5.2f} s; {100 * changed:5.2f}% of its words changed; "
                              f"fingerprint {'match' if served['fingerprint'] == mine else 'MISMATCH'}", flush=True)  # fmt: skip
                    client.close()
            finally:
                server.terminate()
                server.wait(timeout=30)


if __name__ == "__main__":
    main()
