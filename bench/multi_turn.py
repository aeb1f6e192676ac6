"""tandem's multi-turn rollouts with a tool against TRL 1.16's `tools`, on the same machine, task,
model and settings.

    python bench/multi_turn.py [--steps 12] [--configs trl "tandem colocate" ...]

Creates bench/.venv-trl the first time (as bench/vs_trl.py does). TRL parses tool calls with a
response schema it knows only for some chat templates (`add_response_schema`), so both sides use
Qwen3's chat template, read from the installed TRL, on the project's byte-level tokenizer.

Shape: the `tiny` model (0.1M parameters) after a supervised warm-up of 120 steps on calling
the tool (`add(a, b)`) on the demo's prompts, in Qwen3's format, then answering with its result;
prompts of about 725 tokens (Qwen3's tool preamble and the tool's schema, one token a byte),
8 prompts x 8 generations per step, max_tool_calling_iterations 2, completions (every turn and
tool result) of at most 192 tokens, exact_match, beta 0, loss dapo, temperature 1, lr 1e-4,
fp32; each side's other settings at their defaults. (The `small` model's warm-up alone would
take some 15 minutes at this prompt length on 2 cores.)

Printed per configuration: seconds per step and completion tokens/s end to end (medians over the
steps after the first 3; tokens are every token after the prompt, model and inserted alike),
tool calls per trajectory and the reward of the last 5 steps.
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer
from vs_trl import SKIP, TRL_PY, ensure_trl

from common import start_server
from tandem.demo import addition_rows, write_jsonl
from tandem.init_model import init_model, save, warmup_sft
from tandem.rollout.multiturn import TemplateGlue, encode_conversation
from tandem.rollout.tools import make_tool

HERE = Path(__file__).resolve().parent
BATCH, G, LENGTH, ITERATIONS = 64, 8, 192, 2
CONFIGS = ["trl", "tandem colocate", "tandem server sync", "tandem server async"]
TOOL = '''
def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b
'''


def qwen3_template() -> str:
    return subprocess.run([TRL_PY, "-c", "from trl.chat_template_utils import qwen3_chat_template as t; print(t, end='')"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip


def prepare(tmp: Path) -> tuple[Path, Path, Path]:
    """The warmed-up model (with Qwen3's template), the data and the tool's file."""
    (tmp / "tool.py").write_text(TOOL)
    namespace: dict = {}
    exec(TOOL, namespace)  # noqa: S102 - the benchmark's own tool, to build its schema
    model, tok = init_model(tmp / "model", size="tiny", seed=0)
    tok.chat_template = qwen3_template()
    glue = TemplateGlue(tok, {"tools": [make_tool(namespace["add"], "add").schema]}, "the benchmark's model")
    rng, rows = random.Random(0), []
    for _ in range(400):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        call = json.dumps({"name": "add", "arguments": {"a": a, "b": b}})
        messages = [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                    {"role": "tool", "content": str(a + b)}, {"role": "assistant", "content": str(a + b)}]  # fmt: skip
        rows.append(encode_conversation(tok, glue, messages))
    warmup_sft(model, tok, rows=rows, steps=120, lr=1e-2)
    save(model, tok, tmp / "model")
    return tmp / "model", write_jsonl(addition_rows(0), tmp / "data.jsonl"), tmp / "tool.py"


def run(config: str, steps: int, tmp: Path, model: Path, data: Path, tool: Path) -> dict:
    out = tmp / config.replace(" ", "-")
    server = None
    if config == "trl":
        cmd = [TRL_PY, HERE / "trl_run.py", "--model", model, "--data", data, "--out", f"{out}.jsonl", "--steps", steps, "--seed", 0,
               "--batch", BATCH, "--num_generations", G, "--max_completion_length", LENGTH, "--learning_rate", 1e-4, "--bf16", "false",
               "--tools", f"{tool}:add", "--max_tool_calling_iterations", ITERATIONS]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "tandem.cli", "train", "--model_name_or_path", model, "--dataset_name", data,
               "--reward_funcs", "exact_match", "--output_dir", out, "--max_steps", steps, "--seed", 0,
               "--per_device_train_batch_size", BATCH, "--num_generations", G, "--max_completion_length", LENGTH,
               "--learning_rate", 1e-4, "--lr_scheduler_type", "constant", "--beta", 0, "--loss_type", "dapo", "--bf16", "false",
               "--save_steps", 0, "--disable_tqdm", "true", "--tools", f"{tool}:add", "--max_tool_calling_iterations", ITERATIONS,
               "--max_prompt_length", "none"]  # fmt: skip
        if "server" in config:
            server, url = start_server(model, "--dtype", "float32")
            cmd += ["--rollout_mode", "server", "--rollout_server_urls", url, "--async_generate", str("async" in config).lower()]
    try:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit code {proc.returncode}", "log": proc.stderr[-4000:]}
    if config == "trl":
        rows = [json.loads(line) for line in Path(f"{out}.jsonl").read_text().splitlines()]
        tokens = [r["mean_length"] * BATCH for r in rows]
        calls = [r.get("tool_calls") for r in rows]
    else:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        tokens = [r["completion_tokens"] for r in rows]
        calls = [r["tools/call_frequency"] for r in rows]
    times = [b["timestamp"] - a["timestamp"] for a, b in zip(rows[SKIP:], rows[SKIP + 1 :])]
    return {
        "step_s": statistics.median(times),
        "tokens_per_s": sum(tokens[SKIP + 1 :]) / sum(times),
        "calls": statistics.mean(c for c in calls[SKIP + 1 :] if c is not None) if any(c is not None for c in calls) else None,
        "reward": statistics.mean(r["reward"] for r in rows[-5:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    args = ap.parse_args()
    ensure_trl()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model, data, tool = prepare(tmp)
        results = {c: run(c, args.steps, tmp, model, data, tool) for c in args.configs}
    base = results.get("trl", {}).get("tokens_per_s")
    print(f"\nmulti-turn shape: tiny model, {BATCH // G} prompts x {G}, tool add, up to {ITERATIONS} tool turns, {LENGTH} tokens, fp32")
    print(f"{'configuration':<20} {'s/step':>7} {'tokens/s':>9} {'vs TRL':>7} {'calls/traj':>10} {'reward':>7}")
    for config, r in results.items():
        if "error" in r:
            print(f"{config:<20} failed: {r['error']}")
            continue
        ratio = f"{r['tokens_per_s'] / base:>6.2f}x" if base else f"{'':>7}"
        calls = f"{r['calls']:>10.2f}" if r["calls"] is not None else f"{'n/a':>10}"
        print(f"{config:<20} {r['step_s']:>7.2f} {r['tokens_per_s']:>9.0f} {ratio} {calls} {r['reward']:>7.3f}", flush=True)
    for config, r in results.items():
        if "error" in r:
            print(f"\n{config}'s error output:\n{r['log']}")


if __name__ == "__main__":
    main()
