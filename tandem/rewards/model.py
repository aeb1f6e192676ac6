"""Reward models: a sequence-classification model scores prompt + completion, as TRL does.

`--reward_funcs model:NAME` names one (an HF folder or hub name); a folder whose config.json
declares a `...ForSequenceClassification` architecture is recognised without the prefix.
"""

import json
from pathlib import Path

import torch

PREFIX = "model:"


def is_reward_model(spec: str) -> bool:
    if spec.startswith(PREFIX):
        return True
    config = Path(spec) / "config.json"
    if not config.is_file():
        return False
    architectures = json.loads(config.read_text()).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in architectures)


def default_device() -> str:
    """The trainer's device: this process's GPU where there is one, else the CPU."""
    if torch.cuda.is_available():
        from accelerate import PartialState

        return str(PartialState().device)
    return "cpu"


class RewardModel:
    """Callable like a reward function: one float per completion, the model's first logit.

    The model's own tokenizer reads the text: its chat template over the prompt's messages and
    the completion for chat prompts, else the prompt and completion strings joined. Scored in
    batches of `batch_size`, without gradients, on `device` in `dtype` (bf16 on a GPU, fp32 on a CPU
    when "auto").
    """

    def __init__(self, spec: str, device: str = "auto", dtype: str = "auto", batch_size: int = 32, model=None, tokenizer=None):
        """The model `spec` names, or the `model` object given (the Python API's, in its own dtype)
        with `tokenizer` (else the one of its name)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.name = spec.removeprefix(PREFIX)
        self.__name__ = Path(self.name).name  # its metrics' name, TRL's: the last part of its name
        self.device = torch.device(default_device() if device == "auto" else device)
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(self.name)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = model or AutoModelForSequenceClassification.from_pretrained(self.name, num_labels=1, dtype=getattr(torch, dtype))
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # the classifier reads the last non-pad token
        self.model.to(self.device).eval()
        self.batch_size = batch_size

    def text(self, prompt, completion) -> str:
        if isinstance(prompt, list):  # chat messages; the completion is [{"role": "assistant", ...}]
            return self.tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        return prompt + completion

    @torch.no_grad()
    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        texts = [self.text(p, c) for p, c in zip(prompts, completions)]
        scores = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start : start + self.batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            logits = self.model(**batch.to(self.device)).logits  # (B, 1)
            scores.extend(logits[:, 0].float().tolist())
        return scores
