"""Built-in reward functions. Each is `fn(prompts, completions, **kwargs) -> list[float | None]`.

Completions are strings for plain-text prompts and `[{"role": "assistant", "content": ...}]`
for chat prompts (TRL's convention), so user functions written for TRL work unchanged.
"""

import re


def completion_text(completion) -> str:
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"]


def exact_match(prompts, completions, answer=None, **kwargs) -> list[float]:
    """1.0 when the completion, stripped of surrounding whitespace, equals the row's `answer`."""
    if answer is None:
        raise ValueError("exact_match needs an 'answer' column in the dataset")
    return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


THINK_ANSWER = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def think_format(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion is `<think>...</think><answer>...</answer>` (DeepSeek-R1's format)."""
    return [float(bool(THINK_ANSWER.match(completion_text(c)))) for c in completions]


def number_format(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion is a single integer, the demo's answer format."""
    return [float(bool(re.fullmatch(r"\s*-?\d+\s*", completion_text(c)))) for c in completions]


def length_penalty(prompts, completions, completion_ids=None, max_completion_length=None, **kwargs) -> list[float]:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13): 0 up to 80% of
    max_completion_length, then falling linearly to -1 at the limit."""
    if completion_ids is None or not max_completion_length:
        raise ValueError("length_penalty needs completion_ids and max_completion_length")
    start = 0.8 * max_completion_length
    return [-min(1.0, max(0.0, (len(ids) - start) / (max_completion_length - start))) for ids in completion_ids]


BUILTIN_REWARDS = {
    "exact_match": exact_match,
    "think_format": think_format,
    "number_format": number_format,
    "length_penalty": length_penalty,
}
