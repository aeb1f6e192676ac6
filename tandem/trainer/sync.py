"""Publishing the trainer's weights to the rollout engine after each round: the push rule, the
push itself (server mode) and the producer's version gate. The version itself moves in one
place, TrainState.after_round; this makes the new one live."""

import time
from typing import Callable

from tandem.engines.engine import Engine
from tandem.trainer.dist import Dist
from tandem.trainer.producer import SyncProducer
from tandem.trainer.stops import together_collective


class WeightSync:
    def __init__(self, engine: Engine, producer: SyncProducer, dist: Dist, push_collective: Callable[[int], None] | None,
                 wait_for_round_ahead: int | None, last_step: int):  # fmt: skip
        """`push_collective(version)`: make the weights live on the servers as `version` (every rank
        calls it: sharded weights are gathered together; rank 0 pushes), or None where the engine
        runs on the trainer's own weights (colocated). `wait_for_round_ahead`: async mode's
        max_staleness, None in sync mode."""
        self.engine, self.producer, self.dist, self.push_collective = engine, producer, dist, push_collective
        self.wait_for_round_ahead, self.last_step = wait_for_round_ahead, last_step

    def publish_collective(self, version: int, trained_round: int, step: int) -> float:
        """Make `version`, the weights that trained `trained_round`, the engine's; returns the
        seconds it took.

        Async: round trained_round + max_staleness must be generated, on every rank, with the
        version live until now; so the push waits for it (it ran in parallel with the training
        just done, so this wait is usually zero). A failure of either, on any rank, is raised on
        every rank (stops.FAILURES)."""
        t = time.perf_counter()
        if self.wait_for_round_ahead is not None and step < self.last_step:
            together_collective(self.dist, "rounds ahead generated", lambda: self.producer.wait_generated(trained_round + self.wait_for_round_ahead))
        if self.push_collective is not None:
            together_collective(self.dist, "weight push", lambda: self.push_collective(version))
        self.engine.version = version
        self.producer.set_live_version(version)
        return time.perf_counter() - t
