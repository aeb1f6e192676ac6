"""The transformers engine against the vLLM engine, each behind `tandem rollout` with its default
settings, as a new user runs them.

    python bench/engines.py [--rounds 5] [--steps 12] [--warmup 3]

Shape (generation-heavy): the `small` model with heads of 64 (`init-model --size small --head-dim
64`: 4.0M parameters, random init, so completions rarely stop before the limit), 8 prompts x 8
completions of up to 64 tokens, the demo's addition prompts, temperature 1.
1. Generation alone: --rounds requests of 64 completions (new seeds each), completion tokens/s.
2. Training end to end: `tandem train` in server mode, sync and async (max_staleness 1), lr 1e-4;
   median s/step and completion tokens/s after the first --warmup steps.
Needs vLLM (./setup.sh --vllm, then run with .venv-vllm/bin/python); without it, the transformers
engine alone is measured.
"""

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import start_server, timed_server_run  # bench/common.py
from tandem.data import encode_prompt
from tandem.demo import addition_rows, write_jsonl
from tandem.rollout.client import RolloutClient
from tandem.rollout.types import SamplingParams


def generation(url: str, prompts: list[list[int]], rounds: int) -> float:
    client = RolloutClient([url])
    params = SamplingParams(max_tokens=64)
    client.generate(prompts, params, list(range(len(prompts))))  # warm-up
    tokens, start = 0, time.perf_counter()
    for r in range(rounds):
        outs = client.generate(prompts, params, [1000 * (r + 1) + i for i in range(len(prompts))])
        tokens += sum(len(o.token_ids) for o in outs)
    client.close()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    engines = ["transformers"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = tmp / "model"
        subprocess.run([sys.executable, "-m", "tandem.cli", "init-model", model, "--size", "small", "--head-dim", "64"], check=True, capture_output=True)
        rows = addition_rows(0)
        data = write_jsonl(rows, tmp / "data.jsonl")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        prompts = [list(encode_prompt(tokenizer, row["prompt"], None, "error")) for row in rows[:8] for _ in range(8)]
        print("engine        generation alone   train sync               train async")
        for engine in engines:
            started = time.perf_counter()
            server, url = start_server(model, "--engine", engine, timeout=900)
            startup = time.perf_counter() - started
            try:
                gen = generation(url, prompts, args.rounds)
                sync = timed_server_run(url, model, data, tmp / f"{engine}-sync", "sync", args.steps, args.warmup)
                asyn = timed_server_run(url, model, data, tmp / f"{engine}-async", "async", args.steps, args.warmup)
            finally:
                server.terminate()
                server.wait(timeout=60)
            print(f"{engine:<13} {gen:6.0f} tokens/s     {sync[0]:.2f} s/step {sync[1]:5.0f} tok/s   "
                  f"{asyn[0]:.2f} s/step {asyn[1]:5.0f} tok/s   (server started in {startup:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
