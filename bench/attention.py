"""The training forward's attention of completions after their prompt's KV cache, at the
Qwen2.5-0.5B shape: transformers' sdpa with its explicit mask against tandem's causal route
(tandem/attention.py), one layer's forward and backward.

    python bench/attention.py [--rows 8] [--prompt 32] [--tokens 64 256 512 1024] [--dtype bf16] [--repeats 9]

Per completion length: the median ms of a forward and backward through transformers' sdpa with
the mask it builds (every query against every key), and through tandem_sdpa's causal route with
the key/value heads given to sdpa as they are; the two outputs compared. Rows of one prompt
length, so no row is padded (a group's completions); 14 query heads of 64 over 2 key/value heads.
The route is taken from CAUSAL_MIN_QUERIES tokens on; here it is forced at every length.
"""

import argparse
import statistics
import time

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tandem import attention


class Attention(torch.nn.Module):
    """What the attention functions read of a Qwen2 attention layer."""

    num_key_value_groups, layer_idx, is_causal = 7, 0, True


def timed(fn, query, key, value, mask, grad) -> tuple[float, torch.Tensor]:
    for t in (query, key, value):
        t.grad = None
    start = time.perf_counter()
    out, _ = fn(Attention(), query, key, value, mask, scaling=0.125)
    out.backward(grad)
    return (time.perf_counter() - start) * 1e3, out.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8, help="completions in the micro-batch")
    ap.add_argument("--prompt", type=int, default=32, help="tokens in the prompt's cache")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 512, 1024], help="completion lengths to time")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--repeats", type=int, default=9, help="timings of each route, alternating; the median is printed")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    attention.CAUSAL_MIN_QUERIES = 1
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}; {args.rows} rows after {args.prompt} cached tokens, {args.dtype}")
    print(f"{'tokens':>7} {'mask ms':>9} {'causal ms':>10} {'mask/causal':>12} {'max |diff|':>11}")
    torch.manual_seed(0)
    for length in args.tokens:
        keys = args.prompt + length
        query = torch.randn(args.rows, 14, length, 64, dtype=dtype, requires_grad=True)  # (B, H, L, D)
        key, value = (torch.randn(args.rows, 2, keys, 64, dtype=dtype, requires_grad=True) for _ in range(2))  # (B, KVH, S, D)
        mask = (torch.arange(keys) <= torch.arange(args.prompt, keys)[:, None]).expand(args.rows, 1, length, keys)  # (B, 1, L, S)
        grad = torch.randn(args.rows, length, 14, 64, dtype=dtype)
        times = {"mask": [], "causal": []}
        for _ in range(args.repeats):
            ms, theirs = timed(sdpa_attention_forward, query, key, value, mask, grad)
            times["mask"].append(ms)
            ms, ours = timed(attention.tandem_sdpa, query, key, value, mask, grad)
            times["causal"].append(ms)
        plain, causal = statistics.median(times["mask"]), statistics.median(times["causal"])
        print(f"{length:>7} {plain:>9.1f} {causal:>10.1f} {plain / causal:>11.2f}x {(ours - theirs).abs().max().item():>11.2e}")


if __name__ == "__main__":
    main()
