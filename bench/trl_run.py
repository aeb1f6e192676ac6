"""TRL's GRPOTrainer on the benchmark task; runs inside bench/vs_trl.py's own TRL environment.

Writes one JSON line per optimizer step: wall-clock timestamp, reward, completion length, and on
a GPU the peak GPU memory so far (torch.cuda.max_memory_allocated, GiB; on a GPU TRL trains
there, as its users run it).
"""

import argparse
import importlib.util
import json
import time

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def exact_match(prompts, completions, answer, **kwargs):
    return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]


def load_reward(spec: str):
    """A function from "file.py:name" (a reward function or a tool)."""
    path, name = spec.rsplit(":", 1)
    module_spec = importlib.util.spec_from_file_location("reward", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


class StepLog(TrainerCallback):
    def __init__(self, path):
        self.fh = open(path, "w")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            record = {"step": state.global_step, "timestamp": time.time(), "reward": logs["reward"],
                      "mean_length": logs.get("completions/mean_length"), "tool_calls": logs.get("tools/call_frequency")}  # fmt: skip
            if torch.cuda.is_available():
                record["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
            self.fh.write(json.dumps(record) + "\n")
            self.fh.flush()


def main():
    ap = argparse.ArgumentParser()
    for name, kind in [("model", str), ("data", str), ("out", str), ("steps", int), ("batch", int), ("num_generations", int),
                       ("max_completion_length", int), ("learning_rate", float), ("seed", int)]:  # fmt: skip
        ap.add_argument(f"--{name}", type=kind, required=True)
    ap.add_argument("--bf16", choices=["true", "false"], required=True)
    ap.add_argument("--reward", help="file.py:function instead of exact_match")
    ap.add_argument("--tools", nargs="*", default=[], help="file.py:function tools (TRL's `tools`)")
    ap.add_argument("--max_tool_calling_iterations", type=int)
    args = ap.parse_args()
    config = GRPOConfig(
        output_dir=args.out + ".trl",
        per_device_train_batch_size=args.batch,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        beta=0.0,
        loss_type="dapo",
        temperature=1.0,
        max_steps=args.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        bf16=args.bf16 == "true",
        seed=args.seed,
        disable_tqdm=True,
        **({"max_tool_calling_iterations": args.max_tool_calling_iterations} if args.tools else {}),
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.model),
        processing_class=AutoTokenizer.from_pretrained(args.model),
        reward_funcs=[load_reward(args.reward) if args.reward else exact_match],
        args=config,
        train_dataset=load_dataset("json", data_files=args.data, split="train"),
        callbacks=[StepLog(args.out)],
        **({"tools": [load_reward(spec) for spec in args.tools]} if args.tools else {}),
    )
    trainer.train()


if __name__ == "__main__":
    main()
