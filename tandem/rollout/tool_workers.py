"""User code in worker processes: plain tools (`tool_workers`) and agents (`agent_workers`), with
the isolation reward functions have.

A tool or an agent is user code that runs on every turn or episode. In the trainer's process it
can end the run (os._exit, a crash in C), flood its output or hold a thread for ever. In a worker
it takes only its worker with it: the call fails (counted, and the model shown an error or the
agent's episode dropped) and a fresh worker takes its place. A worker's standard output and error
go to /dev/null. Each worker loads the function from its spec ("file.py:fn", "module:fn" or a
built-in tool's name) once, or is sent it (a tool given to the Python API, pickled by
reference), and answers one call at a time.
"""

import multiprocessing
import os
import queue
import threading
import time

from tandem.children import die_with


READY = "ready"  # a worker's first message, once its imports are done


def _quiet(parent: int) -> None:
    die_with(parent)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)  # what the user's code prints, however much, goes nowhere
    os.dup2(quiet, 2)


def serve_tools(conn, parent: int) -> None:
    """A tool worker: (spec, name, arguments) in, (ok, text) out, until the trainer closes the pipe or dies."""
    from tandem.loading import load_object
    from tandem.rollout.tools import BUILTIN_TOOLS, as_text

    _quiet(parent)
    conn.send(READY)
    fns: dict = {}
    while True:
        try:
            spec, name, arguments = conn.recv()
        except EOFError:
            return
        try:
            if callable(spec):  # a function the Python API was given, unpickled
                fns[spec] = spec
            elif spec not in fns:
                fns[spec] = BUILTIN_TOOLS[spec] if spec in BUILTIN_TOOLS else load_object(spec, "tools entry")
            reply = as_text(fns[spec](**arguments), name)
        except SystemExit as exc:
            reply = (False, f"{name} called sys.exit({exc.code!r}); a tool must return its result")
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's to see
            reply = (False, f"{name} raised {type(exc).__name__}: {exc}")
        conn.send(reply)


def serve_agents(conn, parent: int) -> None:
    """An agent worker: (spec, row, base_url, api_key, timeout) in, (result, error) out: the
    agent's return value as a float (or None), or what ended it as text."""
    import asyncio

    import openai

    from tandem.loading import load_object
    from tandem.rollout.agents import contained

    _quiet(parent)
    conn.send(READY)
    fns: dict = {}
    while True:
        try:
            spec, row, base_url, api_key, timeout = conn.recv()
        except EOFError:
            return
        if spec not in fns:
            fns[spec] = load_object(spec, "agent_func")

        async def episode():
            client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)
            try:
                return await contained(fns[spec](row, client))
            finally:
                await client.close()

        result, error = asyncio.run(episode())
        try:
            conn.send((result, error))
        except Exception:  # noqa: BLE001 - a return value that cannot be sent back (pickled) is the agent's failure
            conn.send((None, f"it returned {type(result).__name__}, which cannot leave its worker; return a number (its reward) or None"))


class _Worker:
    def __init__(self, target):
        context = multiprocessing.get_context("spawn")  # a fork of a process with torch's threads can deadlock
        self.conn, child = context.Pipe()
        self.process = context.Process(target=target, args=(child, os.getpid()), name="tandem-worker", daemon=True)
        self.process.start()
        child.close()
        self.started = False  # READY received

    def ready(self, timeout: float) -> bool:
        """Whether the worker has started (its imports done) within `timeout` seconds."""
        if not self.started and self.conn.poll(timeout):
            self.started = self.conn.recv() == READY
        return self.started

    def end(self) -> None:
        self.conn.close()
        self.process.kill()
        self.process.join(timeout=5)


class WorkerFailed(RuntimeError):
    """The call's worker died in it, or outlived its time (it was ended); or none was free in time."""


class Workers:
    """`count` worker processes running `target`, started at the first call. call() blocks its
    thread until the answer, the worker's death or the timeout."""

    def __init__(self, count: int, target=serve_tools):
        self.count, self.target = count, target
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()
        self._all: list[_Worker] = []

    def start(self, timeout: float) -> None:
        """Start the workers, and wait up to `timeout` seconds for each to be ready: the time a
        process takes to start (its imports: seconds) is then no call's."""
        with self._lock:
            if not self._started:
                self._started = True
                for _ in range(self.count):
                    self._add()
            workers = list(self._all)
        deadline = time.monotonic() + timeout
        for worker in workers:
            try:
                if not worker.ready(max(0.0, deadline - time.monotonic())):
                    raise WorkerFailed(f"a worker process did not start within {timeout:g}s")
            except (EOFError, OSError):
                raise WorkerFailed(f"a worker process ended as it started (exit code {worker.process.exitcode})") from None

    def _worker(self, timeout: float) -> _Worker | None:
        with self._lock:
            if not self._started:
                self._started = True
                for _ in range(self.count):
                    self._add()
        try:
            return self._idle.get(timeout=timeout)
        except queue.Empty:
            return None

    def _add(self) -> None:
        worker = _Worker(self.target)
        self._all.append(worker)
        self._idle.put(worker)

    def call(self, request: tuple, timeout: float, what: str):
        """The worker's answer to `request` within `timeout` seconds; WorkerFailed (naming `what`,
        the limit) where it dies in the call or outlives the timeout: it is ended and replaced."""
        deadline = time.monotonic() + timeout
        worker = self._worker(timeout)
        if worker is None:
            raise WorkerFailed(f"took longer than {what} ({timeout:g}s): every worker process was busy")
        try:
            if not worker.ready(max(0.0, deadline - time.monotonic())):
                if worker.process.exitcode is None:
                    raise TimeoutError
                raise EOFError
            worker.conn.send(request)
            if worker.conn.poll(max(0.0, deadline - time.monotonic())):
                reply = worker.conn.recv()
                self._idle.put(worker)
                return reply
            why = f"took longer than {what} ({timeout:g}s); its worker process was ended"
        except TimeoutError:  # before the call began: its worker was still starting
            why = f"took longer than {what} ({timeout:g}s): its worker process was still starting; it was ended"
        except (EOFError, OSError):  # the worker died in the call (os._exit, a crash)
            worker.process.join(timeout=5)
            why = f"ended its worker process (exit code {worker.process.exitcode}); it must return"
        worker.end()
        with self._lock:
            self._all.remove(worker)
            self._add()
        raise WorkerFailed(why)

    def close(self) -> None:
        with self._lock:
            for worker in self._all:
                worker.end()
            self._all.clear()


class ToolWorkers(Workers):
    def __init__(self, count: int):
        super().__init__(count, serve_tools)

    def call(self, spec: str, name: str, arguments: dict, timeout: float) -> tuple[bool, str]:
        """(ok, what the model is shown) of the tool `spec` on `arguments`, within `timeout` seconds."""
        try:
            return super().call((spec, name, arguments), timeout, "tool_timeout")
        except WorkerFailed as exc:
            return False, f"{name} {exc}".replace("it must return", "a tool must return its result")
