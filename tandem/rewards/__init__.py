"""Reward functions: built-ins, user functions from "file.py:fn" or "module:fn", reward models,
weights, timeouts, errors."""

import asyncio
import functools
import json
import math
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tandem.aio import is_async, user_loop
from tandem.loading import load_object, spawn_problem
from tandem.rewards import model as reward_model
from tandem.rewards.builtin import BUILTIN_REWARDS, completion_text
from tandem.rewards.trl import (accuracy_reward, get_cosine_scaled_reward, get_repetition_penalty_reward, get_soft_overlong_punishment,
                                reasoning_accuracy_reward, think_format_reward)  # fmt: skip
from tandem.rewards.workers import PooledReward, WorkerPool

RewardFn = Callable[..., list]
ON_TIMEOUT = ("error", "none")
FLOAT32_MAX = torch.finfo(torch.float32).max  # rewards are trained in float32


class RewardError(RuntimeError):
    """A reward function failed (raised, timed out, exited, returned the wrong values); the
    message names it. The run stops: a user's mistake, reported without a traceback."""


@dataclass(frozen=True)
class NamedReward:
    name: str
    fn: RewardFn
    weight: float
    timeout: float | None = None  # seconds a call may take; None: no bound
    on_timeout: str = "error"  # past the timeout: "error" stops the step, "none" gives no opinion for that batch


class RewardLog:
    """What reward functions log besides their rewards, TRL's way: `log_extra(column, values)`, a
    value per completion of the batch for completions.jsonl, and `log_metric(name, value)`, a
    scalar averaged into the step's metrics. Both are passed to every reward function."""

    def __init__(self, n: int):
        self.n, self.columns, self.metrics = n, {}, {}

    def log_extra(self, column: str, values) -> None:
        self.columns.setdefault(str(column), []).extend(_plain(v) for v in values)

    def log_metric(self, name: str, value) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))

    def rows(self) -> list[dict]:
        """Each completion's logged columns; a column of other than one value per completion is a RewardError."""
        for column, values in self.columns.items():
            if len(values) != self.n:
                raise RewardError(f"log_extra({column!r}, ...) was given {len(values)} values for a batch of {self.n} completions; "
                                  "give one per completion")  # fmt: skip
        return [{c: v[i] for c, v in self.columns.items()} for i in range(self.n)]


def _plain(value):
    """A logged value as JSON holds it (completions.jsonl, checkpoints): numpy's and torch's scalars
    as numbers, anything else JSON cannot hold as its text."""
    value = value.item() if hasattr(value, "item") and getattr(value, "ndim", 0) == 0 else value
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def load_reward_fn(spec: str, model_options: dict | None = None) -> RewardFn:
    """A built-in name, "path/to/file.py:fn", "package.module:fn", or a reward model
    ("model:NAME", or a folder holding a sequence-classification model)."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if reward_model.is_reward_model(spec):
        try:
            return reward_model.RewardModel(spec, **(model_options or {}))
        except (OSError, ValueError) as exc:
            raise ValueError(f"reward_funcs entry {spec!r}: no sequence-classification model loads from there ({exc})") from exc
    if ":" not in spec:
        raise ValueError(
            f"reward_funcs entry {spec!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) "
            "nor of the form 'path/to/file.py:function' or 'package.module:function'"
        )
    return load_object(spec, "reward_funcs entry")


def reward_name(spec: str) -> str:
    """The name metrics use: "digit_fraction", not the file path; a reward model's folder name."""
    if reward_model.is_reward_model(spec):
        return Path(spec.removeprefix(reward_model.PREFIX)).name
    return spec.rsplit(":", 1)[-1]


def load_rewards(entries: list, weights: list[float] | None, timeout: float | None = None, on_timeout: str = "error",
                 model_options: dict | None = None, num_workers: int = 0) -> list[NamedReward]:  # fmt: skip
    """The reward functions of `entries`, specs (loaded here) or callables (named by __name__, as
    TRL names them), checked. With num_workers, the plain ones (not async, not reward models)
    score in that many worker processes; close_rewards ends them."""
    if not entries:
        raise ValueError("reward_funcs is empty; give at least one, e.g. --reward_funcs exact_match")
    if weights is None:
        weights = [1.0] * len(entries)
    if len(weights) != len(entries):
        raise ValueError(f"reward_weights has {len(weights)} values for {len(entries)} reward_funcs; give one weight each")
    names = [reward_name(e) if isinstance(e, str) else callable_name(e) for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"reward_funcs {names} has two functions of the same name; their metrics would collide")
    fns = [load_reward_fn(e, model_options) if isinstance(e, str) else _checked(e) for e in entries]
    if num_workers:
        pool = WorkerPool(num_workers)
        for i, (entry, fn) in enumerate(zip(entries, fns)):
            if not is_async(fn) and not isinstance(fn, reward_model.RewardModel):
                fns[i] = PooledReward(entry if isinstance(entry, str) else _to_workers(fn, names[i], num_workers), pool, timeout)
    return [NamedReward(name, fn, float(w), timeout, on_timeout) for name, fn, w in zip(names, fns, weights)]


def callable_name(fn) -> str:
    """A reward function's metric name, TRL's: its __name__ (a partial's function's, an object's class's)."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(inner, "__name__", None) or type(inner).__name__


def trl_spec(name: str) -> str:
    """A reward named by a string in a TRL script: tandem's spec as it is (a built-in, 'file.py:fn',
    'model:NAME', a folder), else a reward model's hub name, as TRL reads it."""
    return name if name in BUILTIN_REWARDS or ":" in name or reward_model.is_reward_model(name) else f"{reward_model.PREFIX}{name}"


def _checked(fn):
    if not callable(fn) or type(fn).__module__.startswith("transformers"):
        raise ValueError(f"reward_funcs entry {fn!r}: give a function, a reward spec, or a reward model's name or folder (not a model object)")
    return fn


def _to_workers(fn, name: str, num_workers: int):
    """fn, where spawned workers can have it (loading.spawn_problem)."""
    problem = spawn_problem(fn)
    if problem:
        raise ValueError(f"reward function {name!r} cannot reach reward_num_workers={num_workers} worker processes: {problem}; "
                         "or give reward_num_workers 0")  # fmt: skip
    return fn


def close_rewards(rewards: list[NamedReward]) -> None:
    """End the worker processes of pooled functions, if any."""
    for reward in rewards:
        if isinstance(reward.fn, PooledReward):
            reward.fn.pool.close()


def score(rewards: list[NamedReward], prompts: list, completions: list, log: RewardLog | None = None, **kwargs) -> torch.Tensor:
    """Rewards of every completion under every function: (N, F) float, NaN where a function said
    None; what they log besides goes to `log`.

    `async def` functions run concurrently with each other and with the plain ones, which run
    one after another in a worker thread; on the process's loop for user coroutines
    (tandem.aio), so what an async function keeps across rounds (a client, a semaphore) stays
    bound to the loop it runs on. Each call is bounded by its function's timeout. A
    function that raises, times out under the "error" policy, or returns the wrong number or kind
    of values fails the step with its name; None and NaN mean "no opinion" and are left out of
    the statistics.
    """
    n = len(completions)
    log = log or RewardLog(n)
    kwargs = {"prompts": prompts, "completions": completions, **kwargs, "log_extra": log.log_extra, "log_metric": log.log_metric}
    results = user_loop().run(_call_all(rewards, kwargs))
    columns = [_column(reward, values, n) for reward, values in zip(rewards, results)]
    # One tensor built at the end, not N*F indexed writes: cheaper, and this runs in the async producer's thread.
    return torch.tensor(columns, dtype=torch.float32).T.reshape(n, len(rewards))  # (N, F)


async def _call_all(rewards: list[NamedReward], kwargs: dict) -> list:
    n = len(kwargs["completions"])
    results: list = [None] * len(rewards)
    asynchronous = [is_async(r.fn) for r in rewards]

    async def plain_in_turn() -> None:
        for i, reward in enumerate(rewards):
            if not asynchronous[i]:
                results[i] = await _bounded(reward, lambda reward=reward: _in_thread(reward.fn, kwargs), n)

    async def one_async(i: int) -> None:
        results[i] = await _bounded(rewards[i], lambda: rewards[i].fn(**kwargs), n)

    await asyncio.gather(plain_in_turn(), *(one_async(i) for i in range(len(rewards)) if asynchronous[i]))
    return results


def _in_thread(fn: RewardFn, kwargs: dict) -> asyncio.Future:
    """fn(**kwargs) in a daemon thread: one that outlives its timeout keeps running but blocks
    neither the next round nor the process's exit (asyncio's own executor would do both)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome: str, value) -> None:
        if not future.done():
            getattr(future, outcome)(value)

    def run() -> None:
        try:
            outcome, value = "set_result", fn(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller, with the function's name
            outcome, value = "set_exception", exc
        loop.call_soon_threadsafe(settle, outcome, value)  # the process's loop: still running

    threading.Thread(target=run, daemon=True, name="tandem-reward").start()
    return future


async def _bounded(reward: NamedReward, start: Callable, n: int) -> list:
    """The values of `start()`'s awaitable, within the function's timeout, under its policy."""
    limit = None if isinstance(reward.fn, PooledReward) else reward.timeout  # the pool bounds its own calls, and ends stuck workers
    try:
        async with asyncio.timeout(limit):
            return await start()
    except TimeoutError:
        if reward.on_timeout == "none":
            print(f"tandem: warning: reward function {reward.name!r} took longer than reward_timeout={reward.timeout:g}s; "
                  f"its {n} rewards of this batch are None (reward_on_timeout=none)", file=sys.stderr, flush=True)  # fmt: skip
            return [None] * n
        raise RewardError(f"reward function {reward.name!r} took longer than reward_timeout={reward.timeout:g}s; "
                           "raise reward_timeout, or give reward_on_timeout=none to score such a batch as no opinion") from None  # fmt: skip
    except SystemExit as exc:  # from user code: a failure, never the run's exit (it ended runs with 0 after no step)
        raise RewardError(f"reward function {reward.name!r} called sys.exit({exc.code!r}); a reward function must return its rewards") from None
    except Exception as exc:
        raise RewardError(f"reward function {reward.name!r} raised {type(exc).__name__}: {exc}") from exc


def _column(reward: NamedReward, values, n: int) -> list[float]:
    """A function's values, checked: n floats or None (NaN), none infinite."""
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        raise RewardError(f"reward function {reward.name!r} must return a list of {n} floats (one per completion), got {got}")
    column = []
    for i, v in enumerate(values):
        if v is None:
            v = math.nan
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise RewardError(f"reward function {reward.name!r} returned {v!r} for completion {i}; expected a float or None") from None
        if math.isinf(v):
            raise RewardError(f"reward function {reward.name!r} returned {v} for completion {i}; rewards must be finite (None or NaN means no opinion)")
        if abs(v) > FLOAT32_MAX:  # would become inf in the float32 table below
            raise RewardError(
                f"reward function {reward.name!r} returned {v:g} for completion {i}; rewards must be finite in float32, the "
                f"precision they are trained in (|reward| <= {FLOAT32_MAX:.4g}): scale the function's rewards down"
            )
        column.append(float(v))
    return column


def combine(table: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """Weighted sum over functions, ignoring NaN; NaN only where every function had no opinion.

    table: (N, F) -> (N,)
    """
    w = torch.tensor(weights, dtype=table.dtype)  # (F,)
    total = torch.nansum(table * w, dim=1)  # (N,)
    unknown = torch.isnan(table).all(dim=1)  # (N,)
    return torch.where(unknown, torch.full_like(total, math.nan), total)


__all__ = ["BUILTIN_REWARDS", "ON_TIMEOUT", "NamedReward", "RewardError", "RewardLog", "accuracy_reward", "callable_name", "combine", "completion_text",
           "close_rewards", "get_cosine_scaled_reward", "get_repetition_penalty_reward", "get_soft_overlong_punishment", "load_reward_fn", "load_rewards",
           "reasoning_accuracy_reward", "reward_name", "score", "think_format_reward", "trl_spec"]  # fmt: skip
