"""Reward functions: built-ins, user functions from "file.py:fn" or "module:fn", weights, errors."""

import importlib
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tandem.rewards.builtin import BUILTIN_REWARDS, completion_text

RewardFn = Callable[..., list]


@dataclass(frozen=True)
class NamedReward:
    name: str
    fn: RewardFn
    weight: float


def load_reward_fn(spec: str) -> RewardFn:
    """A built-in name, "path/to/file.py:fn" or "package.module:fn"."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(
            f"reward_funcs entry {spec!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) "
            "nor of the form 'path/to/file.py:function' or 'package.module:function'"
        )
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise FileNotFoundError(f"reward_funcs entry {spec!r}: file {path} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"tandem_user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward_funcs entry {spec!r}: {where} has no function {name!r}")
    return fn


def load_rewards(specs: list[str], weights: list[float] | None) -> list[NamedReward]:
    if not specs:
        raise ValueError("reward_funcs is empty; give at least one, e.g. --reward_funcs exact_match")
    if weights is None:
        weights = [1.0] * len(specs)
    if len(weights) != len(specs):
        raise ValueError(f"reward_weights has {len(weights)} values for {len(specs)} reward_funcs; give one weight each")
    names = [spec.rsplit(":", 1)[-1] for spec in specs]  # metrics say "digit_fraction", not the file path
    if len(set(names)) != len(names):
        raise ValueError(f"reward_funcs {specs} has two functions of the same name; their metrics would collide")
    return [NamedReward(name, load_reward_fn(spec), float(w)) for name, spec, w in zip(names, specs, weights)]


def score(rewards: list[NamedReward], prompts: list, completions: list, **kwargs) -> torch.Tensor:
    """Rewards of every completion under every function: (N, F) float, NaN where a function said None.

    A function that raises or returns the wrong number or kind of values fails the step with
    its name; None and NaN mean "no opinion" and are left out of the statistics.
    """
    n = len(completions)
    columns = []
    for reward in rewards:
        try:
            values = reward.fn(prompts=prompts, completions=completions, **kwargs)
        except Exception as exc:
            raise RuntimeError(f"reward function {reward.name!r} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            raise ValueError(f"reward function {reward.name!r} must return a list of {n} floats (one per completion), got {got}")
        column = []
        for i, v in enumerate(values):
            if v is None:
                v = math.nan
            elif isinstance(v, bool) or not isinstance(v, (int, float)):
                try:
                    v = float(v)
                except (TypeError, ValueError):
                    raise ValueError(f"reward function {reward.name!r} returned {v!r} for completion {i}; expected a float or None") from None
            if math.isinf(v):
                raise ValueError(f"reward function {reward.name!r} returned {v} for completion {i}; rewards must be finite (None or NaN means no opinion)")
            column.append(float(v))
        columns.append(column)
    # One tensor built at the end, not N*F indexed writes: cheaper, and this runs in the async producer's thread.
    return torch.tensor(columns, dtype=torch.float32).T.reshape(n, len(rewards))  # (N, F)


def combine(table: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """Weighted sum over functions, ignoring NaN; NaN only where every function had no opinion.

    table: (N, F) -> (N,)
    """
    w = torch.tensor(weights, dtype=table.dtype)  # (F,)
    total = torch.nansum(table * w, dim=1)  # (N,)
    unknown = torch.isnan(table).all(dim=1)  # (N,)
    return torch.where(unknown, torch.full_like(total, math.nan), total)


__all__ = ["BUILTIN_REWARDS", "NamedReward", "combine", "completion_text", "load_reward_fn", "load_rewards", "score"]
