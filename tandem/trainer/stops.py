"""How a run stops between rounds before its end: on SIGTERM (a scheduler preempting the job),
or when a rollout server or a round fails it. Each says what the run kept and what to do."""

import os
import signal
import sys
import threading

from tandem.rollout.client import RolloutServerError
from tandem.trainer.checkpoint import where_to_resume
from tandem.trainer.producer import RoundTimeout

SIGTERM_EXIT = 143  # 128 + SIGTERM, as a process the signal ended


class OtherRankFailed(RuntimeError):
    """This process stops because another training process failed at the same point of the round."""


class AgentsFailing(RuntimeError):
    """Most of the agents failed, step after step (metrics.AgentFailures): the run trains little
    but noise, and the agents' own error is what to fix."""

    every_rank = True  # decided on the step's record, the same on every rank


# What stops a run between rounds with a checkpoint of what it trained: a rollout server gone or
# refusing, a round that never came, agents that fail. Raised on every rank together
# (Dist.together_collective, or decided on a record reduced over them).
FAILURES = (RolloutServerError, RoundTimeout, OtherRankFailed, AgentsFailing)


def together_collective(dist, what: str, fn):
    """fn() on every rank; where it fails on any (FAILURES), every rank raises here."""
    return dist.together_collective(fn, what, FAILURES, lambda: OtherRankFailed(f"another training process's {what} failed (its message says why)"))


class Preempted(RuntimeError):
    """The run stopped on SIGTERM (a scheduler preempting the job), with a checkpoint of what it trained."""


class Flag:
    """SIGTERM as a flag the loop reads between rounds, from construction until restore(), with
    a bound: `timeout` seconds after the first signal, or at a second one, the process exits with
    code 143 whatever it is doing (a round stuck on a reward function or a server, a collective
    waiting for a rank that is), its last checkpoint intact and the round in flight dropped.

    Python runs signal handlers in the main thread only, and only between bytecodes, so a main
    thread waiting in C (a collective) would run none for as long as it waits. The signal is
    seen at once instead through signal.set_wakeup_fd: the interpreter's own C handler writes its
    number into a pipe that a daemon thread reads. Set up from the main thread only."""

    def __init__(self, signum: int, timeout: float, output_dir: str):
        self.signum, self.timeout, self.output_dir = signum, timeout, output_dir
        self._event, self._old, self._old_fd, self._write = threading.Event(), None, None, None
        if threading.current_thread() is not threading.main_thread():
            return
        self._old = signal.signal(signum, lambda *_: None)  # the flag is raised by the thread below
        read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read,), name="tandem-sigterm", daemon=True).start()

    def is_set(self) -> bool:
        return self._event.is_set()

    def _watch(self, read: int) -> None:
        with os.fdopen(read, "rb", buffering=0) as pipe:
            while data := pipe.read(64):
                for _ in range(data.count(self.signum)):
                    if self._event.is_set():
                        self._exit("a second SIGTERM came")
                    self._event.set()
                    timer = threading.Timer(self.timeout, self._exit, (f"the round in flight did not end within sigterm_timeout={self.timeout:g}s",))
                    timer.daemon = True
                    timer.start()

    def _exit(self, why: str) -> None:
        """Exit now, saying what the run keeps: its last checkpoint, which no save in flight can
        have broken (a save is put in place whole, or not at all)."""
        print(f"tandem: stopped by SIGTERM: {why}; what this process had trained since its last checkpoint is dropped, and "
              f"{where_to_resume(self.output_dir)}",
              file=sys.stderr, flush=True)  # fmt: skip
        sys.stdout.flush()
        os._exit(SIGTERM_EXIT)

    def restore(self) -> None:
        """The signal's previous handling back. A SIGTERM already seen keeps its bound: the exit
        that follows must not hang either."""
        if self._old is not None:
            signal.set_wakeup_fd(self._old_fd)
            signal.signal(self.signum, self._old)
            os.close(self._write)  # its reader ends


def after_failure(run, exc: Exception, saved_at: int) -> str:
    """What a run stopped by a server or by a round that never came keeps, and what to do. We
    are between rounds, every process at the same point (the failure was raised on all of them
    together): they save what they trained since the last checkpoint, where the producer holds
    a state that matches the trainer's weights (partial rollouts whose last calls failed do not:
    there the last checkpoint stands)."""
    if getattr(exc, "unreachable", False):
        fix = "restart the rollout server"
    elif isinstance(exc, RoundTimeout):
        fix = "find what held the round up"
    else:
        fix = "fix what the message above names"
    kept, state, dist = "the last checkpoint is", run.state, run.dist
    together = dist.world == 1 or getattr(exc, "every_rank", False)
    if together and state.step > saved_at and dist.all_collective(run.producer.checkpointable(state.version), "a checkpoint after the failure"):
        run.checkpointer.save_collective(state)
        saved_at, kept = state.step, "checkpoint saved"
    trained = f"trained {state.step} of {run.schedule.max_steps} steps"
    if saved_at == 0:
        return f"tandem: {trained}, none saved; {fix}, then start the run again"
    return f"tandem: {trained}; {kept} at step {saved_at}; {fix}, then resume with --resume_from_checkpoint latest --output_dir {run.schedule.output_dir}"


def preempted(run, saved_at: int) -> str:
    """Every rank saw a SIGTERM's flag (the round in flight has finished): save, say how to resume."""
    if saved_at != run.state.step:
        run.checkpointer.save_collective(run.state)
    step = run.state.step
    if not step:
        return "stopped by SIGTERM before any step; no step was trained: start the run again"
    return (f"stopped by SIGTERM after step {step} (the round in flight finished); checkpoint-{step} holds it: resume with "
            f"--resume_from_checkpoint latest --output_dir {run.schedule.output_dir}")  # fmt: skip
