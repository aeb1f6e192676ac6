"""Built-in reward functions. Each is `fn(prompts, completions, **kwargs) -> list[float | None]`.

Completions are strings for plain-text prompts and `[{"role": "assistant", "content": ...}]`
for chat prompts (TRL's convention), so user functions written for TRL work unchanged.
"""

import logging
import re


def completion_text(completion) -> str:
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"]


def exact_match(prompts, completions, answer=None, **kwargs) -> list[float | None]:
    """1.0 when the completion, stripped of surrounding whitespace, equals the row's `answer`; no
    opinion (None) for a row whose answer is missing (null), which is not the text "None"."""
    if answer is None:
        raise ValueError("exact_match needs an 'answer' column in the dataset")
    return [None if a is None else float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


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


def accuracy(prompts, completions, solution=None, **kwargs) -> list[float | None]:
    """1.0 when the completion's answer equals the row's `solution` by math-verify (equivalent
    expressions count; LaTeX, boxed or plain), 0.0 when not, None when the solution does not parse.

    math-verify's own timeouts use signals, which work only on the main thread: they are off
    here, and reward_timeout bounds the call instead.
    """
    if solution is None:
        raise ValueError("accuracy needs a 'solution' column in the dataset")
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call that its timeouts are off
    rewards = []
    for completion, gold_text in zip(completions, solution):
        gold = parse(str(gold_text), parsing_timeout=None)
        if not gold:
            rewards.append(None)
            continue
        answer = parse(completion_text(completion), parsing_timeout=None)
        rewards.append(float(verify(gold, answer, timeout_seconds=None)))
    return rewards


def environment(prompts, completions, environment_reward=None, **kwargs) -> list[float | None]:
    """Each trajectory's environment's get_reward() (multi-turn runs with environment_factory)."""
    if environment_reward is None:
        raise ValueError("the environment reward needs environment_factory, with a class that has get_reward()")
    return list(environment_reward)


BUILTIN_REWARDS = {
    "environment": environment,
    "exact_match": exact_match,
    "accuracy": accuracy,
    "think_format": think_format,
    "number_format": number_format,
    "length_penalty": length_penalty,
}
