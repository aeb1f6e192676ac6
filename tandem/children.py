"""Processes that must not outlive the one that started them, however it ended: the workers
tandem starts for user code (reward functions, tools) end with their trainer, and the trainers a
launcher (torchrun, accelerate launch) starts end with their launcher."""

import os
import select
import sys
import threading


def die_with(parent: int, why: str | None = None) -> None:
    """End this worker when `parent`, the trainer, is gone, however it ended (SIGKILL included):
    a worker busy in user code would otherwise spin on, orphaned. A thread waits on the parent's
    pidfd (a parent-death signal would fire when the thread that started the worker ends, which
    in a pool is not the trainer's end). `why`: said on stderr as the process ends."""
    try:
        watched = os.pidfd_open(parent)
    except ProcessLookupError:
        os._exit(1)  # the trainer died before this worker started
    except (OSError, AttributeError):
        return  # no pidfd (not Linux, or a kernel before 5.3): the pool's own terminate() only

    def watch():
        select.select([watched], [], [])
        if why:
            print(f"tandem: process {os.getpid()}: {why}; it ends too (what it trained since its last checkpoint is dropped)", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="tandem-die-with-trainer", daemon=True).start()
