"""Plain reward functions in a pool of worker processes (`reward_num_workers`).

A batch is cut into one contiguous slice per worker; each worker loads the function from its
spec ("file.py:fn", "module:fn" or a built-in name), or unpickles it, and scores its slice, so
CPU-heavy functions run in parallel, each on its own main thread (where signal-based timeouts, such as
math-verify's defaults, work). A call past its timeout terminates the pool, stuck worker
included, and the next call starts a fresh one.
"""

import multiprocessing
import os
import time

from tandem.children import die_with

_FNS: dict = {}  # in a worker: spec -> function


def _start_worker(parent: int) -> None:
    import torch

    torch.set_num_threads(1)  # the pool's workers share the cores
    die_with(parent)


def _score_slice(spec, kwargs: dict) -> tuple[list, dict, dict]:
    """`spec`'s values on this slice (a spec, loaded once, or the function itself, unpickled),
    and what it logged (log_extra's columns, log_metric's values)."""
    from tandem.rewards import RewardLog, load_reward_fn

    if isinstance(spec, str) and spec not in _FNS:
        _FNS[spec] = load_reward_fn(spec)
    log = RewardLog(len(kwargs["completions"]))
    try:
        values = list((_FNS[spec] if isinstance(spec, str) else spec)(**kwargs, log_extra=log.log_extra, log_metric=log.log_metric))
        return values, log.columns, log.metrics
    except SystemExit as exc:  # would end this worker and leave its task unanswered until the timeout
        raise RuntimeError(f"called sys.exit({exc.code!r})") from None


class WorkerPool:
    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self._pool = None

    def _started(self):
        if self._pool is None:
            # spawn: a fork of a process with torch's threads and the producer's thread can deadlock
            self._pool = multiprocessing.get_context("spawn").Pool(self.num_workers, initializer=_start_worker, initargs=(os.getpid(),))
        return self._pool

    def score(self, spec, kwargs: dict, timeout: float | None) -> list:
        """fn(**kwargs) over the workers: every list argument as long as the batch is sliced, the
        rest passed whole; what the slices log is logged here, in their order. Raises TimeoutError
        (after terminating the pool) past `timeout`."""
        log_extra, log_metric = kwargs.pop("log_extra"), kwargs.pop("log_metric")
        n = len(kwargs["completions"])
        parts = min(self.num_workers, n) or 1
        bounds = [n * i // parts for i in range(parts + 1)]
        slices = [
            {k: v[lo:hi] if isinstance(v, (list, tuple)) and len(v) == n else v for k, v in kwargs.items()}
            for lo, hi in zip(bounds, bounds[1:])
        ]
        pending = [self._started().apply_async(_score_slice, (spec, part)) for part in slices]
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            results = [result.get(None if deadline is None else max(0.0, deadline - time.monotonic())) for result in pending]
        except multiprocessing.TimeoutError:
            self.close()
            raise TimeoutError(f"reward workers took longer than {timeout}s") from None
        for _, columns, metrics in results:
            for column, values in columns.items():
                log_extra(column, values)
            for name, values in metrics.items():
                for value in values:
                    log_metric(name, value)
        return [value for values, _, _ in results for value in values]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


class PooledReward:
    """A plain reward function, called like one, that scores in the pool's worker processes: its
    spec, or the function (a callable the workers unpickle by reference)."""

    def __init__(self, spec, pool: WorkerPool, timeout: float | None):
        self.spec, self.pool, self.timeout = spec, pool, timeout  # the pool enforces the timeout

    def __call__(self, **kwargs) -> list:
        return self.pool.score(self.spec, kwargs, self.timeout)
