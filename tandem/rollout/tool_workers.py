"""Plain tools in worker processes (`tool_workers`): the isolation reward functions have.

A tool is user code fed by model output on every turn. In the trainer's process it can end the
run (os._exit, a crash in C), flood its output or hold a thread forever. In a worker it takes only
its worker with it: the call fails (the model is shown an error, the metrics count it), and a
fresh worker takes its place. A worker's standard output and error go to /dev/null. Each worker
loads the tool from its spec ("file.py:fn", "module:fn" or a built-in name) once, and answers one
call at a time; results come back as the text the model is shown.
"""

import multiprocessing
import os
import queue
import threading
import time

from tandem.children import die_with


def _serve(conn, parent: int) -> None:
    """A worker: calls in, (ok, text) out, until the trainer closes the pipe or dies."""
    from tandem.loading import load_object
    from tandem.rollout.tools import BUILTIN_TOOLS, as_text

    die_with(parent)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)  # a tool's prints, however many, go nowhere
    os.dup2(quiet, 2)
    fns: dict = {}
    while True:
        try:
            spec, name, arguments = conn.recv()
        except EOFError:
            return
        try:
            if spec not in fns:
                fns[spec] = BUILTIN_TOOLS[spec] if spec in BUILTIN_TOOLS else load_object(spec, "tools entry")
            reply = as_text(fns[spec](**arguments), name)
        except SystemExit as exc:
            reply = (False, f"{name} called sys.exit({exc.code!r}); a tool must return its result")
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's to see
            reply = (False, f"{name} raised {type(exc).__name__}: {exc}")
        conn.send(reply)


class _Worker:
    def __init__(self):
        context = multiprocessing.get_context("spawn")  # a fork of a process with torch's threads can deadlock
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, os.getpid()), name="tandem-tool-worker", daemon=True)
        self.process.start()
        child.close()

    def end(self) -> None:
        self.conn.close()
        self.process.kill()
        self.process.join(timeout=5)


class ToolWorkers:
    """`count` worker processes, started at the first call. call() blocks its thread (the tool
    runner's) until the answer, the worker's death or the timeout."""

    def __init__(self, count: int):
        self.count = count
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()
        self._all: list[_Worker] = []

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
        worker = _Worker()
        self._all.append(worker)
        self._idle.put(worker)

    def call(self, spec: str, name: str, arguments: dict, timeout: float) -> tuple[bool, str]:
        """(ok, what the model is shown) of the tool `spec` on `arguments`, within `timeout`
        seconds: a worker that dies in the call, or outlives the timeout, is ended and replaced."""
        deadline = time.monotonic() + timeout
        worker = self._worker(timeout)
        if worker is None:
            return False, f"{name} took longer than tool_timeout ({timeout:g}s): every tool worker was busy"
        try:
            worker.conn.send((spec, name, arguments))
            if worker.conn.poll(max(0.0, deadline - time.monotonic())):
                reply = worker.conn.recv()
                self._idle.put(worker)
                return reply
            why = f"{name} took longer than tool_timeout ({timeout:g}s); its worker process was ended"
        except (EOFError, OSError):  # the worker died in the call (os._exit, a crash)
            worker.process.join(timeout=5)
            why = f"{name} ended its worker process (exit code {worker.process.exitcode}); a tool must return its result"
        worker.end()
        with self._lock:
            self._all.remove(worker)
            self._add()
        return False, why

    def close(self) -> None:
        with self._lock:
            for worker in self._all:
                worker.end()
            self._all.clear()
