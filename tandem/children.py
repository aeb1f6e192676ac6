"""Worker processes tandem starts for user code (reward functions, tools): each ends with the
trainer that started it, however the trainer ended."""

import os
import select
import threading


def die_with(parent: int) -> None:
    """End this worker when `parent`, the trainer, is gone, however it ended (SIGKILL included):
    a worker busy in user code would otherwise spin on, orphaned. A thread waits on the parent's
    pidfd (a parent-death signal would fire when the thread that started the worker ends, which
    in a pool is not the trainer's end)."""
    try:
        watched = os.pidfd_open(parent)
    except ProcessLookupError:
        os._exit(1)  # the trainer died before this worker started
    except (OSError, AttributeError):
        return  # no pidfd (not Linux, or a kernel before 5.3): the pool's own terminate() only

    def watch():
        select.select([watched], [], [])
        os._exit(1)

    threading.Thread(target=watch, name="tandem-die-with-trainer", daemon=True).start()
