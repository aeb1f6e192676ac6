"""Where user code runs: coroutines (async tools and reward functions) on one event loop that
lives as long as the process, in a daemon thread of its own; plain functions in daemon threads.

A fresh `asyncio.run` per round bound whatever the user's code keeps across calls (a semaphore,
an HTTP client, a connection pool) to round 0's loop and failed it in every later round; TRL
keeps one loop for the same reason. One loop for all of them: an object a tool or a reward
function keeps is bound to the loop every later call runs on, whichever round, thread or caller.
Daemon threads: a call that never returns (a hung tool, reward or environment step) must not keep
the process alive after the run ends, where a ThreadPoolExecutor's threads are joined at exit.
"""

import asyncio
import inspect
import queue
import threading
from concurrent.futures import Future
from typing import Awaitable, Callable


def is_async(fn) -> bool:
    """Whether calling fn gives a coroutine: an `async def` function (or a partial of one), or an
    object whose __call__ is one (ms-swift's AsyncORM, a TRL callable class)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(type(fn), "__call__", None))


_user_loop: "LoopThread | None" = None
_user_loop_lock = threading.Lock()


class LoopThread:
    """An event loop in a daemon thread; `run(coro)` runs a coroutine on it from any other thread."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=name, daemon=True).start()

    def run(self, coro: Awaitable):
        """The coroutine's result (or its exception), waiting for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


def user_loop() -> LoopThread:
    """The process's loop for user coroutines, started at its first use."""
    global _user_loop
    with _user_loop_lock:
        if _user_loop is None:
            _user_loop = LoopThread("tandem-user-loop")
        return _user_loop


def in_thread(fn: Callable, *args, name: str) -> tuple[Future, threading.Thread]:
    """fn(*args) in a daemon thread started for the call, which ends with it: its future (the
    result, or whatever it raised, SystemExit included) and the thread. A call whose future was
    cancelled before the thread began does not run."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever holds the future
            future.set_exception(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return future, thread


async def in_own_thread(fn: Callable, *args):
    """in_thread, awaited without blocking the event loop. For torch work beside a thread that
    computes (a server's engine): each thread that runs a parallel torch op keeps a team of
    OpenMP threads while it lives, and a live second team slowed every op of the engine's decode
    steps (a server's step at the Qwen2.5-0.5B shape: 131-137 against 102-114 ms after one weight
    push staged in a pooled thread; libgomp spins only briefly where it manages more threads than
    cores, which fits, but was not traced). A thread that ends gives its team back."""
    return await asyncio.wrap_future(in_thread(fn, *args, name="tandem-own-thread")[0])


class DaemonPool:
    """`workers` daemon threads running submitted calls, as a ThreadPoolExecutor does, but never
    joined at exit. A call that never returns holds its thread: once every thread is held, later
    calls wait (and time out where their caller bounds them) rather than start more threads."""

    def __init__(self, workers: int, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()
        self.workers = workers

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """fn(*args, **kwargs) on a free thread; its outcome in the future, SystemExit included
        (as its exception: the caller decides what a user's sys.exit means)."""
        future: Future = Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args, kwargs = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, whatever it is
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Idle threads end; busy ones end after their call."""
        for _ in range(self.workers):
            self._calls.put(None)
