"""TRL's GRPO quickstart with its import line changed: `from trl import` became `from tandem import`.

    python examples/trl_quickstart.py                  # TRL's own: Qwen2-0.5B-Instruct on trl-lib/tldr (the hub)
    python examples/trl_quickstart.py MODEL DATA.jsonl # another model and a prompt file, as docs/from-trl.md runs it
    accelerate launch --num_processes 2 examples/trl_quickstart.py MODEL DATA.jsonl

Below the import, only the model, the data and a shorter run (TRL's default is 3 epochs of
completions of 256 tokens) differ from TRL's page.
"""

import sys

from datasets import load_dataset

from tandem import GRPOConfig, GRPOTrainer

model, data = (sys.argv[1], sys.argv[2]) if len(sys.argv) > 2 else ("Qwen/Qwen2-0.5B-Instruct", None)
dataset = load_dataset("json", data_files=data, split="train") if data else load_dataset("trl-lib/tldr", split="train")


# Reward completions close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion if isinstance(completion, str) else completion[0]["content"])) for completion in completions]


training_args = GRPOConfig(output_dir="runs/Qwen2-0.5B-GRPO", max_steps=4 if data else -1, max_completion_length=16 if data else 256, logging_steps=1)
trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=training_args, train_dataset=dataset)
trainer.train()
trainer.save_model()
