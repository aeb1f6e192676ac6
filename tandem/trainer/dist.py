"""The training processes as the trainer sees them: this one's rank, the world, the device, and
every collective the trainer runs between them. A method that runs a collective ends in
`_collective`; every rank must call the same ones in the same order, or they wait on each other
until ddp_timeout.

With TANDEM_TRACE_COLLECTIVES=<folder>, each rank appends the name of every collective it enters
to <folder>/rank<r>.txt (the collectives inside sharded forwards and DDP's backward included), so
a test can check that the ranks' sequences are the same.
"""

import os
from pathlib import Path
from typing import Callable, TypeVar

import torch

TRACE = "TANDEM_TRACE_COLLECTIVES"
T = TypeVar("T")


class Dist:
    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.rank = accelerator.process_index
        self.world = accelerator.num_processes
        self.is_main = accelerator.is_main_process
        self.device = accelerator.device
        folder = os.environ.get(TRACE)
        self._trace = open(Path(folder) / f"rank{self.rank}.txt", "a") if folder else None

    def enter(self, name: str) -> None:
        """Record a collective about to run (a no-op unless tracing)."""
        if self._trace is not None:
            self._trace.write(name + "\n")
            self._trace.flush()

    def gather_collective(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's `t`, concatenated in rank order along dim 0 (back on the CPU)."""
        self.enter(f"gather {what}")
        if self.world == 1:
            return t
        return self.accelerator.gather(t.to(self.device)).cpu()

    def sum_collective(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """The sum of every rank's `t` (back on the CPU)."""
        self.enter(f"sum {what}")
        if self.world == 1:
            return t
        return self.accelerator.reduce(t.to(self.device), reduction="sum").cpu()

    def objects_collective(self, obj, what: str) -> list:
        """Every rank's `obj` (picklable), in rank order."""
        self.enter(f"objects {what}")
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def all_collective(self, flag: bool, what: str) -> bool:
        """Whether `flag` holds on every rank (a sharded engine's lockstep: decoding goes on until
        every rank's sequences are done)."""
        self.enter(f"all {what}")
        if self.world == 1:
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return bool(t.item())

    def together_collective(self, fn: Callable[[], T], what: str, errors: tuple[type[BaseException], ...], instead: Callable[[], BaseException]) -> T:
        """fn() on every rank, then whether it raised one of `errors` on any (a collective in
        itself, so a barrier too). If it did, every rank raises at this same point: its own error,
        or instead() where fn went well here, each marked `every_rank`. So the processes stop
        together, where they can still save or clean up together; one that went on alone would
        wait in its next collective until ddp_timeout, and one that cleaned up alone (a staging
        folder removed) would fail the others' writes with errors that name the wrong cause."""
        error, result = None, None
        try:
            result = fn()
        except errors as exc:
            error = exc
        if not self.all_collective(error is None, f"together: {what}"):
            error = error or instead()
            error.every_rank = True
            raise error
        return result

    def barrier_collective(self, what: str) -> None:
        self.enter(f"barrier {what}")
        self.accelerator.wait_for_everyone()

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
