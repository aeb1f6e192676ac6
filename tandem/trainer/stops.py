"""How a run stops between rounds before its end: on SIGTERM (a scheduler preempting the job),
or when a rollout server or a round fails it. Each says what the run kept and what to do."""

import signal
import threading

from tandem.trainer.producer import RoundTimeout


class Preempted(RuntimeError):
    """The run stopped on SIGTERM (a scheduler preempting the job), with a checkpoint of what it trained."""


class Flag:
    """A signal that raises a flag instead of ending the process, from construction until
    restore() (in the main thread only: Python runs handlers there)."""

    def __init__(self, signum: int):
        self.signum, self._event, self._old = signum, threading.Event(), None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signum, lambda *_: self._event.set())

    def is_set(self) -> bool:
        return self._event.is_set()

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(self.signum, self._old)


def after_failure(run, exc: Exception, saved_at: int) -> str:
    """What a run stopped by a server or by a round that never came keeps, and what to do. We
    are between rounds: one process saves what it trained since its last checkpoint (with
    several, the others may be anywhere, so the last periodic checkpoint stands)."""
    if getattr(exc, "unreachable", False):
        fix = "restart the rollout server"
    elif isinstance(exc, RoundTimeout):
        fix = "find what held the round up"
    else:
        fix = "fix what the message above names"
    kept = "the last checkpoint is"
    if run.dist.world == 1 and run.state.step > saved_at:
        run.checkpointer.save_collective(run.state)
        saved_at, kept = run.state.step, "checkpoint saved"
    if saved_at == 0:
        return f"tandem: no step was trained; {fix}, then start the run again"
    return f"tandem: {kept} at step {saved_at}; {fix}, then resume with --resume_from_checkpoint latest --output_dir {run.schedule.output_dir}"


def preempted(run, saved_at: int) -> str:
    """Every rank saw a SIGTERM's flag (the round in flight has finished): save, say how to resume."""
    if saved_at != run.state.step:
        run.checkpointer.save_collective(run.state)
    step = run.state.step
    if not step:
        return "stopped by SIGTERM before any step; no step was trained: start the run again"
    return (f"stopped by SIGTERM after step {step} (the round in flight finished); checkpoint-{step} holds it: resume with "
            f"--resume_from_checkpoint latest --output_dir {run.schedule.output_dir}")  # fmt: skip
