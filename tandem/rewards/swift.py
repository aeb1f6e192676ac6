"""ms-swift's reward functions: its registry `orms` of reward classes, the common ones with
ms-swift 4's definitions (swift/rewards/orm.py), and its plugin files (`external_plugins`), which
register more by `orms['name'] = Class` after `from swift.rewards import ORM, orms`.

A class is made with the run's config as `args` (its options carry ms-swift's names: cosine_*,
repetition_*, soft_*, max_completion_length) and called as ms-swift calls it: `completions` as
strings, the dataset's columns, `messages` (the conversation, the completion last),
`response_token_ids` and `trainer_state`. Where ms-swift is installed, a plugin's `swift.rewards`
is ms-swift's own; else a stand-in that holds this module's classes and registry.
"""

import logging
import math
import re
import sys
import types
from pathlib import Path
from typing import Callable

from tandem.aio import is_async
from tandem.loading import load_module
from tandem.rewards.builtin import BUILTIN_REWARDS, completion_text


class ORM:
    """ms-swift's base of a reward class: made with the run's config, called with keywords."""

    def __init__(self, args=None, **kwargs):
        self.args = args

    def __call__(self, **kwargs) -> list:
        raise NotImplementedError


class AsyncORM(ORM):
    """A reward class whose __call__ is `async def` (it awaits I/O); scored beside the others."""

    async def __call__(self, **kwargs) -> list:
        raise NotImplementedError


class Format(ORM):
    """1.0 for `<think>...</think>` then `<answer>...</answer>` and nothing after."""

    PATTERN = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>(?![\s\S])", re.DOTALL | re.MULTILINE)

    def __call__(self, completions, **kwargs) -> list:
        return [float(bool(self.PATTERN.match(c))) for c in completions]


class ReActFormat(Format):
    """1.0 for `<think>...</think>` then `Action: ...` and `Action Input: ...`."""

    PATTERN = re.compile(r"^<think>.*?</think>\s*Action:.*?Action Input:.*?$", re.DOTALL | re.MULTILINE)


def _answer(text: str) -> tuple[str, bool]:
    """The text inside <answer>...</answer>, stripped, and whether there was such a tag."""
    found = re.search(r"<answer>(.*?)</answer>", text, re.DOTALL)
    return (found.group(1).strip(), True) if found else (text, False)


class MathAccuracy(ORM):
    """1.0 when the completion's answer (inside <answer> tags if it has them, else its LaTeX, boxed
    first) equals the row's `solution` by math-verify; 0.0 otherwise, and where the solution does
    not parse (ms-swift's rule; tandem's own `accuracy` gives no opinion there)."""

    def __call__(self, completions, solution=None, **kwargs) -> list:
        if solution is None:
            raise ValueError("ms-swift's accuracy reward needs a 'solution' column in the dataset")
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify

        # math-verify's signal timeouts work only on the main thread: off (it warns of that on every
        # call), and reward_timeout bounds the call instead
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        untagged = [LatexExtractionConfig(normalization_config=NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True,
                                                                                   boxed="all", units=True),
                                          boxed_match_priority=0, try_extract_without_anchor=False)]  # fmt: skip
        rewards = []
        for completion, gold_text in zip(completions, solution):
            gold = parse(_answer(str(gold_text))[0], extraction_mode="first_match", parsing_timeout=None)
            text, tagged = _answer(completion)
            if not gold:
                rewards.append(0.0)
                continue
            options = {} if tagged else {"extraction_config": untagged}
            answer = parse(text, extraction_mode="first_match", parsing_timeout=None, **options)
            try:
                rewards.append(float(verify(gold, answer, timeout_seconds=None)))
            except Exception:  # noqa: BLE001 - math-verify's comparison of odd expressions; ms-swift scores them 0
                rewards.append(0.0)
        return rewards


class CosineReward(ORM):
    """Accuracy shaped by length on a cosine (arXiv:2502.03373, eq. 1): a correct answer's reward
    falls from cosine_min_len_value_correct at length 0 to cosine_max_len_value_correct at
    cosine_max_len tokens; a wrong one's rises from cosine_min_len_value_wrong to _max_len_value_wrong."""

    def __init__(self, args=None, accuracy_orm=None, **kwargs):
        super().__init__(args)
        self.accuracy = accuracy_orm or MathAccuracy(args)

    def __call__(self, completions, solution=None, response_token_ids=None, **kwargs) -> list:
        a = self.args
        rewards = []
        for ids, correct in zip(response_token_ids, self.accuracy(completions=completions, solution=solution, **kwargs)):
            start, end = (a.cosine_min_len_value_correct, a.cosine_max_len_value_correct) if correct >= 1 else \
                         (a.cosine_min_len_value_wrong, a.cosine_max_len_value_wrong)  # fmt: skip
            rewards.append(end + (start - end) * (1 + math.cos(math.pi * len(ids) / a.cosine_max_len)) / 2)
        return rewards


class RepetitionPenalty(ORM):
    """repetition_max_penalty times the share of the completion's word n-grams that repeat an
    earlier one (arXiv:2502.03373); 0 for a completion of fewer than repetition_n_grams words."""

    def __call__(self, completions, **kwargs) -> list:
        n = self.args.repetition_n_grams
        rewards = []
        for completion in completions:
            words = completion.lower().split()
            grams = list(zip(*(words[i:] for i in range(n))))
            rewards.append((1 - len(set(grams)) / len(grams)) * self.args.repetition_max_penalty if len(words) >= n else 0.0)
        return rewards


class SoftOverlong(ORM):
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13) as ms-swift gives it: 0 up to
    soft_max_length - soft_cache_length tokens, then -1 per soft_cache_length tokens beyond."""

    def __call__(self, completions, response_token_ids=None, **kwargs) -> list:
        cache = self.args.soft_cache_length
        expected = self.args.soft_max_length - cache
        return [min(-(len(ids) - expected) / cache, 0.0) for ids in response_token_ids]


orms: dict[str, type] = {
    "accuracy": MathAccuracy,
    "format": Format,
    "react_format": ReActFormat,
    "cosine": CosineReward,
    "repetition": RepetitionPenalty,
    "soft_overlong": SoftOverlong,
}


def resolve(entries: list, plugins: list[str], args, prefer: bool) -> list:
    """`entries` with ms-swift's reward names made its rewards: those its plugins register, and the
    registry's others where tandem has no built-in of the name or `prefer` (defaults swift) asks
    for ms-swift's. Each class is made once, with `args`."""
    names = {e for e in entries if isinstance(e, str)}
    if not plugins and not any(n in orms and (prefer or n not in BUILTIN_REWARDS) for n in names):
        return entries  # nothing of ms-swift's: its package is not imported
    registry, registered = import_plugins(plugins)
    out = []
    for entry in entries:
        if isinstance(entry, str) and entry in registry and (prefer or entry in registered or entry not in BUILTIN_REWARDS):
            orm = registry[entry](args)
            entry = (AsyncSwiftReward if is_async(orm) else SwiftReward)(entry, orm)
        out.append(entry)
    return out


_REGISTERED: dict[Path, set[str]] = {}  # plugin file -> the names it registered (a file runs once a process)


def import_plugins(paths: list[str]) -> tuple[dict[str, type], set[str]]:
    """The registry after importing each plugin file, and the names the plugins registered. A
    plugin's `from swift.rewards import ORM, orms` gets ms-swift's where it is installed."""
    try:
        from swift.rewards import orms as registry  # ms-swift's own, with its classes
    except ImportError:
        registry = orms
        _stand_in()
    for path in paths:
        key = Path(path).resolve()
        if key not in _REGISTERED:
            before = dict(registry)
            load_module(path, f"external_plugins entry {path!r}")  # runs the file
            _REGISTERED[key] = {n for n, cls in registry.items() if before.get(n) is not cls}
    return registry, set().union(*(_REGISTERED[Path(p).resolve()] for p in paths))


def _stand_in() -> None:
    """`swift.rewards` (and ms-swift 3's `swift.plugin`) as modules holding this one's ORM,
    AsyncORM and orms, for plugins written against ms-swift where it is not installed."""
    if "swift" in sys.modules:
        return
    package = types.ModuleType("swift")
    package.__path__ = []  # a package, so that `import swift.rewards` finds its submodules here
    sys.modules["swift"] = package
    for name in ("rewards", "plugin"):
        module = types.ModuleType(f"swift.{name}")
        module.ORM, module.AsyncORM, module.orms = ORM, AsyncORM, orms
        sys.modules[f"swift.{name}"] = module
        setattr(package, name, module)


class SwiftReward:
    """An ms-swift reward class's instance called by tandem's convention: TRL's keywords in,
    ms-swift's out. Its metric is the registered name."""

    def __init__(self, name: str, orm: Callable):
        self.__name__, self.orm = name, orm

    def __call__(self, prompts, completions, **kwargs) -> list:
        return self.orm(**swift_kwargs(prompts, completions, kwargs))


class AsyncSwiftReward(SwiftReward):
    async def __call__(self, prompts, completions, **kwargs) -> list:
        return await self.orm(**swift_kwargs(prompts, completions, kwargs))


def swift_kwargs(prompts: list, completions: list, kwargs: dict) -> dict:
    """ms-swift's reward arguments: completions as text, each row's conversation with its
    completion as `messages`, the token ids as `response_token_ids` too."""
    texts = [completion_text(c) for c in completions]
    messages = [([{"role": "user", "content": p}] if isinstance(p, str) else list(p)) + [{"role": "assistant", "content": t}]
                for p, t in zip(prompts, texts)]  # fmt: skip
    return {**kwargs, "completions": texts, "messages": messages, "response_token_ids": kwargs.get("completion_ids")}
