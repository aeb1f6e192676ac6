"""LoRA against full fine-tuning on the `medium` model: peak memory, step time, bytes per sync.

    python bench/lora.py [--steps 8] [--batch 8] [--max_completion_length 256] [--lora_r 16]

Shape: the `medium` model (25M parameters, random init, fp32: it rarely stops, so completions
run to the length limit), the demo's prompts and exact-match reward, and tandem's defaults: a
step of 8 completions (one prompt, 8 generations) of up to 256 tokens. `--batch 64
--max_completion_length 64` is bench/vs_trl.py's long shape. LoRA: use_peft with TRL's
defaults (lora_r 16, alpha 32, dropout 0.05) on all-linear. Each configuration trains in its own
process, colocated and then against a `tandem rollout` server (sync), one after the other.
A last run repeats LoRA colocated with lora_dropout 0.
Printed per configuration: peak resident memory of the training process (ru_maxrss), median
seconds of the training phase and of a whole step after the first 2 steps, median seconds of a
weight sync, and the bytes a sync pushes (the tensors the trainer sends, as sent: fp32).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from common import start_server  # bench/common.py
from tandem.demo import addition_rows, write_jsonl
from tandem.init_model import init_model

SKIP = 2
# Runs `tandem train` in this process and prints its peak resident memory (KiB on Linux) last.
TRAIN = "import resource, sys; from tandem.cli import main; rc = main(sys.argv[1:]); print('peak_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)"


def run(model: Path, data: Path, out: Path, args, lora: list[str], server: list[str]) -> dict:
    cmd = [sys.executable, "-c", TRAIN, "train", "--model_name_or_path", model, "--dataset_name", data, "--output_dir", out,
           "--reward_funcs", "exact_match", "--per_device_train_batch_size", args.batch,
           "--max_completion_length", args.max_completion_length, "--max_steps", args.steps, "--learning_rate", "1e-4", "--save_steps", "0",
           "--disable_tqdm", "true", *lora, *server]  # fmt: skip
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"trainer failed:\n{proc.stderr[-3000:]}")
    peak = int(proc.stdout.strip().splitlines()[-1].split()[1])
    m = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][SKIP:]
    step = statistics.median(b["timestamp"] - a["timestamp"] for a, b in zip(m, m[1:]))
    return {"peak_mib": peak / 1024, "train": statistics.median(x["time/train"] for x in m), "step": step,
            "sync": statistics.median(x["time/weight_sync"] for x in m)}  # fmt: skip


def pushed_bytes(model_dir: Path, lora_r: int) -> tuple[int, int]:
    """Bytes of the tensors one sync sends: every weight, and the adapters of a fresh LoRA run."""
    from peft import LoraConfig, get_peft_model

    from tandem.trainer.lora import adapter_weights

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    full = sum(t.numel() * t.element_size() for _, t in model.named_parameters())
    adapted = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear"))
    return full, sum(t.numel() * t.element_size() for _, t in adapter_weights(adapted))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="completions per step (per_device_train_batch_size)")
    ap.add_argument("--max_completion_length", type=int, default=256)
    ap.add_argument("--lora_r", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = tmp / "medium"
        init_model(model_dir, size="medium", seed=0)
        data = write_jsonl(addition_rows(0), tmp / "data.jsonl")
        full_bytes, lora_bytes = pushed_bytes(model_dir, args.lora_r)
        lora = ["--use_peft", "true", "--lora_r", str(args.lora_r), "--lora_alpha", str(2 * args.lora_r), "--lora_target_modules", "all-linear"]
        server, url = start_server(model_dir)
        try:
            rows = {}
            for name, opts in (("full", []), ("lora", lora)):
                for mode, extra in (("colocate", []), ("server", ["--rollout_mode", "server", "--rollout_server_urls", url])):
                    rows[name, mode] = run(model_dir, data, tmp / f"{name}-{mode}", args, opts, extra)
                    print(f"{name} {mode}: {rows[name, mode]}", flush=True)
            # Dropout makes each adapted layer keep its own dropped copy of its input for backward.
            rows["lora dropout 0", "colocate"] = run(model_dir, data, tmp / "lora0", args, [*lora, "--lora_dropout", "0"], [])
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"\nmedium model (25M parameters), fp32, {torch.get_num_threads()} threads, {args.batch} completions of up to {args.max_completion_length} tokens per step")
    print(f"{'':27} {'peak MiB':>9} {'train s':>8} {'step s':>7} {'sync s':>7} {'bytes/sync':>11}")
    for (name, mode), r in rows.items():
        pushed = (full_bytes if name == "full" else lora_bytes) if mode == "server" else 0
        print(f"{name + ' ' + mode:27} {r['peak_mib']:9.0f} {r['train']:8.3f} {r['step']:7.3f} {r['sync']:7.3f} {pushed:11,d}")
    for name, mode in (("lora", "colocate"), ("lora", "server"), ("lora dropout 0", "colocate")):
        f, l = rows["full", mode], rows[name, mode]
        print(f"{name} / full, {mode}: peak memory {l['peak_mib'] / f['peak_mib']:.2f}x, train {l['train'] / f['train']:.2f}x, step {l['step'] / f['step']:.2f}x")
    print(f"bytes per sync: lora {lora_bytes:,d} / full {full_bytes:,d} = {lora_bytes / full_bytes:.4f}")


if __name__ == "__main__":
    main()
