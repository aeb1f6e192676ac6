"""TRL's reward functions (trl.rewards, TRL 1.16), with its definitions and names, so that a TRL
script's `from trl.rewards import accuracy_reward` becomes `from tandem.rewards import
accuracy_reward`. Completions may be TRL's message lists or plain text.

math-verify bounds its work with signals, which only the main thread can use: there (a reward
worker) TRL's timeouts apply; elsewhere none, and reward_timeout bounds the call.
"""

import logging
import math
import re
import threading

from tandem.rewards.builtin import completion_text


def _timeouts() -> tuple[int | None, int | None]:
    """math-verify's parsing and verifying timeouts, TRL's: on the main thread only."""
    if threading.current_thread() is threading.main_thread():
        return 10, 5
    for name in ("math_verify.parser", "math_verify.grader", "math_verify"):
        logging.getLogger(name).setLevel(logging.ERROR)  # it warns on every call that its timeouts are off
    return None, None


def _verified(answers: list[str], solution: list, log_extra) -> list[float | None]:
    """1.0 where an answer's LaTeX (boxed first, anchored) equals the solution by math-verify, 0.0
    where not, None where the solution does not parse; log_extra gets what was parsed."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    parsing, verifying = _timeouts()
    config = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0, try_extract_without_anchor=False)]
    rewards, golds, parsed = [], [], []
    for answer, gold_text in zip(answers, solution, strict=True):
        if answer is None:  # reasoning_accuracy_reward: the reasoning never ended
            rewards.append(0.0)
            golds.append("[incomplete reasoning]")
            parsed.append("[incomplete reasoning]")
            continue
        gold = parse(str(gold_text), parsing_timeout=parsing)
        if not gold:
            rewards.append(None)
            golds.append("[unparseable]")
            parsed.append("[skipped]")
            continue
        got = parse(answer, extraction_config=config, extraction_mode="first_match", parsing_timeout=parsing)
        rewards.append(float(verify(gold, got, timeout_seconds=verifying)))
        golds.append(str(gold))
        parsed.append(str(got) if got else "[unparseable]")
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", golds)
        log_extra("answer_parsed", parsed)
    return rewards


def accuracy_reward(completions, solution, log_extra=None, **kwargs) -> list[float | None]:
    """1.0 when the completion's answer equals the row's `solution` by math-verify, 0.0 when not,
    None (no opinion) when the solution does not parse."""
    return _verified([completion_text(c) for c in completions], solution, log_extra)


def reasoning_accuracy_reward(completions, solution, reasoning_delimiters=None, log_extra=None, **kwargs) -> list[float | None]:
    """accuracy_reward of what follows the reasoning (after the last of `reasoning_delimiters`,
    default </think>); 0.0 for a completion whose reasoning never ends."""
    delimiters = reasoning_delimiters or ["</think>"]
    answers = []
    for completion in completions:
        text = completion_text(completion)
        ending = next((d for d in delimiters if d in text), None)
        answers.append(None if ending is None else text.split(ending)[-1])
    return _verified(answers, solution, log_extra)


THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion opens with one <think>...</think> block."""
    return [1.0 if THINK.match(completion_text(c)) else 0.0 for c in completions]


class CosineScaledReward:
    """Correctness (accuracy_reward) scaled by length on a cosine (arXiv:2502.03373, appendix C.1):
    v_min + (v_max - v_min)(1 + cos(pi min(|y| / max_len, 1))) / 2, where a correct completion's
    (v_min, v_max) is (min_value_correct, max_value_correct) and a wrong one's (max_value_wrong,
    min_value_wrong); None where the solution does not parse."""

    __name__ = "cosine_scaled_reward"

    def __init__(self, max_len: int, min_value_wrong: float, max_value_wrong: float, min_value_correct: float, max_value_correct: float):
        self.max_len, self.wrong, self.correct = max_len, (max_value_wrong, min_value_wrong), (min_value_correct, max_value_correct)

    def __call__(self, completions, solution, completion_ids, **kwargs) -> list[float | None]:
        rewards = []
        for right, ids in zip(accuracy_reward(completions, solution), completion_ids, strict=True):
            if right is None:
                rewards.append(None)
                continue
            low, high = self.correct if right else self.wrong
            rewards.append(low + 0.5 * (high - low) * (1.0 + math.cos(min(len(ids) / self.max_len, 1.0) * math.pi)))
        return rewards


def get_cosine_scaled_reward(max_len: int, min_value_wrong: float = -1.0, max_value_wrong: float = -0.5, min_value_correct: float = 0.5,
                             max_value_correct: float = 1.0) -> CosineScaledReward:  # fmt: skip
    return CosineScaledReward(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)


class RepetitionPenaltyReward:
    """max_penalty times the share of the completion's token n-grams that repeat an earlier one
    (arXiv:2502.03373, appendix C.2); 0 for a completion of fewer than ngram_size tokens."""

    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float):
        self.ngram_size, self.max_penalty = ngram_size, max_penalty

    def __call__(self, completion_ids, **kwargs) -> list[float]:
        rewards = []
        for ids in completion_ids:
            grams = list(zip(*(ids[i:] for i in range(self.ngram_size))))
            repeated = 1 - len(set(grams)) / len(grams) if grams else 0.0
            rewards.append(repeated * self.max_penalty if repeated else 0.0)
        return rewards


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> RepetitionPenaltyReward:
    if max_penalty > 0:
        raise ValueError(f"max_penalty {max_penalty} should not be positive")
    return RepetitionPenaltyReward(ngram_size, max_penalty)


class SoftOverlongPunishment:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13): 0 up to max_completion_len -
    soft_punish_cache tokens, falling linearly to -1 at max_completion_len, -1 beyond."""

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        self.max_completion_len, self.cache = max_completion_len, soft_punish_cache

    def __call__(self, completion_ids, **kwargs) -> list[float]:
        start = self.max_completion_len - self.cache
        return [0.0 if len(ids) <= start else (start - len(ids)) / self.cache if len(ids) <= self.max_completion_len else -1.0 for ids in completion_ids]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)


__all__ = ["accuracy_reward", "get_cosine_scaled_reward", "get_repetition_penalty_reward", "get_soft_overlong_punishment", "reasoning_accuracy_reward",
           "think_format_reward"]  # fmt: skip
