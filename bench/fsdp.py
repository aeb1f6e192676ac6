"""DDP against FSDP (`--fsdp full_shard`) on the `medium` model (25M parameters) with 2 training
processes: peak memory per process, time per step, and the weight push from shards.

    python bench/fsdp.py [--steps 6] [--push-only]

Shape 1, training: `tandem train` under torchrun with 2 processes against a `tandem rollout`
server on this host, in sync mode: 8 prompts x 8 completions of up to 64 tokens a step (4
prompts per process), the addition data, exact_match, otherwise default settings. Prints the
medians after the first step of the seconds per step, of time/train and of time/weight_sync, and
the run's memory/peak_gb/max (the peak resident memory of the process that peaked highest).

Shape 2, one push alone, in 2 worker processes of this script: rank 0's resident memory before
the push and its peak during it (Linux's VmHWM, reset just before), with 16 MiB buckets so the
model spans several. DDP pushes every parameter as the trainer does (the client keeps a copy for
a restarted server); FSDP gathers one tensor at a time and stages the push on disk a bucket at
a time (tandem.trainer.sharding.stage), as the trainer does.
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

sys.path.insert(0, str(Path(__file__).parent))
from common import free_port, start_server  # noqa: E402

BUCKET = 16 * 2**20


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def push_worker(url: str, model_dir: str, mode: str, folder: str) -> None:
    """Under torchrun: one push of the model, DDP-style or from shards; rank 0 prints its figures."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from tandem.rollout.client import RolloutClient
    from tandem.trainer import sharding

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if mode == "fsdp":
        sharding.shard(model, sharding.Plan(reshard_after_forward=True, layer_classes=None), False, torch.device("cpu"))
    client = RolloutClient([url], weight_bucket_bytes=BUCKET)
    dist.barrier()
    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = time.perf_counter()
    if mode == "fsdp":
        staged = sharding.stage(model.named_parameters(), Path(folder), BUCKET, rank == 0)
        if rank == 0:
            client.push_weights(staged, version=1, force=True)
    elif rank == 0:
        client.push_weights(list(model.named_parameters()), version=1, force=True)
    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20  # a DTensor counts its whole size
        local = sum(getattr(p, "to_local", lambda p=p: p)().numel() * p.element_size() for p in model.parameters()) / 2**20
        print(json.dumps({"mode": mode, "model_mb": size, "local_mb": local, "rss_mb": before / 1024, "push_extra_mb": (_status_kb("VmHWM") - before) / 1024, "seconds": seconds}))
    dist.destroy_process_group()


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), *args]


def train_run(url: str, model: Path, data: Path, out: Path, steps: int, *extra: str) -> dict:
    cmd = torchrun("-m", "tandem.cli", "train", "--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
                   "--reward_funcs", "exact_match", "--num_generations", "8", "--per_device_train_batch_size", "32",
                   "--max_completion_length", "64", "--max_steps", str(steps), "--save_steps", "0", "--disable_tqdm", "true",
                   "--rollout_mode", "server", "--rollout_server_urls", url, *extra)  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"trainer failed:\n{proc.stderr[-3000:]}")
    m = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = m[1:]
    return {
        "step_s": statistics.median(b["timestamp"] - a["timestamp"] for a, b in zip(m, m[1:])),
        "train_s": statistics.median(x["time/train"] for x in later),
        "sync_s": statistics.median(x["time/weight_sync"] for x in later),
        "peak_gb": m[-1]["memory/peak_gb/max"],
    }


def training(url: str, model: Path, data: Path, work: Path, steps: int) -> None:
    print("shape 1: medium model, 2 processes, server sync, 8 prompts x 8 completions of <= 64 tokens a step")
    rows = {name: train_run(url, model, data, work / name, steps, *extra) for name, extra in (("ddp", ()), ("fsdp", ("--fsdp", "full_shard")))}
    print(f"{'':6} {'s/step':>8} {'train s':>8} {'push s':>8} {'peak GB/process':>16}")
    for name, r in rows.items():
        print(f"{name:6} {r['step_s']:8.2f} {r['train_s']:8.2f} {r['sync_s']:8.2f} {r['peak_gb']:16.3f}")
    d, f = rows["ddp"], rows["fsdp"]
    print(f"fsdp/ddp: step {f['step_s'] / d['step_s']:.2f}x, train {f['train_s'] / d['train_s']:.2f}x, push {f['sync_s'] / d['sync_s']:.2f}x, "
          f"peak memory {f['peak_gb'] / d['peak_gb']:.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--push-only", action="store_true", help="shape 2 alone")
    parser.add_argument("--push-worker", nargs=4, metavar=("URL", "MODEL", "MODE", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.push_worker:
        return push_worker(*args.push_worker)

    from tandem.demo import addition_rows, write_jsonl

    work = Path(tempfile.mkdtemp(prefix="tandem-bench-fsdp-"))
    model, data = work / "medium", write_jsonl(addition_rows(0), work / "addition.jsonl")
    subprocess.run([sys.executable, "-m", "tandem.cli", "init-model", str(model), "--size", "medium"], check=True, capture_output=True)
    server, url = start_server(model, env={"OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))})
    try:
        if not args.push_only:
            training(url, model, data, work, args.steps)
        print(f"shape 2: one push of the medium model from rank 0 of 2, {BUCKET // 2**20} MiB buckets")
        for mode in ("ddp", "fsdp"):
            proc = subprocess.run(torchrun(__file__, "--push-worker", url, str(model), mode, str(work / f"push-{mode}")), capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"push worker failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"{mode:6} model {r['model_mb']:.0f} MB, rank 0 holds {r['local_mb']:.0f} MB of it (the optimizer state and gradients: 3x that), "
                  f"resident {r['rss_mb']:.0f} MB before the push, "
                  f"+{r['push_extra_mb']:.0f} MB at its peak during it, {r['seconds']:.2f} s")  # fmt: skip
    finally:
        server.kill()


if __name__ == "__main__":
    main()
