"""Partial rollouts: sequences carried across weight updates at fixed token budgets.

A round's completions need not be generated in one engine call at one version. With token
budgets (max_tokens_per_round = B), the producer keeps the sequences of every admitted round in
flight together: at each version, one engine call decodes at most B more tokens of every
unfinished sequence; a sequence that is not finished continues at the next version from its
exact tokens (prefilled again: the engine never sees text), beside the sequences of later
rounds. The short completions of later rounds fill the engine's batch while a long one of an
earlier round runs, where a whole round would decode its longest completion alone.

Where a sequence changes weights is fixed by token counts, never by timing:
  round r is admitted (takes its prompts) at version first(r) = max(0, r - k), k = max_staleness;
  it is due at version due(r) = max(0, r - 1) (r itself when k = 0): the trainer trains it after
    version r is live, so it must be finished by the end of that version's calls;
  at version v, one call decodes at most B more tokens of every admitted unfinished sequence
    (its chunk-th call draws from seed turn_seed(seed, chunk)); then calls without a budget
    finish, alone, the sequences of the rounds due at v that are still unfinished (those longer
    than their versions' budgets: none when k * B >= max_completion_length);
  a round is scored and handed over when it is due; with dynamic sampling, the groups that
    replace its agreeing ones are generated then, whole, at its due version.
With tools (multi-turn), a model turn may span calls and versions; when it ends its tools run and
the results are inserted, and the next turn starts in the next call (Stepwise in multiturn.py).
So every token trained at round r is of a version in [r - k, r - 1], each sequence's chunks and
versions depend only on the seed and its own length, and N processes (each with its own groups)
make the same sequences as one. The trainer pushes version v + 1 only after version v's calls
(wait_generated), as for whole rounds.

A checkpoint holds the sequences in flight after the last version's calls (carried) and the
rounds due by then; a resumed run goes on from them, bitwise.
"""

import time
from dataclasses import dataclass, fields, replace

from tandem.rollout.multiturn import Stepwise, Live, turn_seed
from tandem.trainer.producer import AsyncProducer, Round, RoundTimeout, completion_seed, table_prompts, to_rollout


@dataclass
class Flight:
    """One admitted round's trajectories while they are generated."""

    index: int
    indices: list[int]  # dataset rows of its groups
    slots: list[int]
    seqs: list[Live]  # one per completion: its tokens, log-probs, versions, seed and turns so far
    sampler_state: dict  # the sampler right after this round took its prompts
    generate_seconds: float = 0.0
    occupancy_tokens: int = 0  # of the calls at its due version: tokens kept
    occupancy_slots: int = 0  # and sequences x decode steps

    def saved(self) -> dict:
        """JSON, for a checkpoint."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "seqs"}, "seqs": [t.saved() for t in self.seqs]}

    @classmethod
    def restore(cls, saved: dict, turns: Stepwise, prompts: list) -> "Flight":
        """From saved(); `prompts`: its completions' prompts, in order."""
        return cls(**{**saved, "seqs": [turns.restore(t, p) for t, p in zip(saved["seqs"], prompts, strict=True)]})


class PartialProducer(AsyncProducer):
    """AsyncProducer's contract (next_round, wait_generated, set_live_version, checkpoints) with
    the rounds generated as partial rollouts, each version's calls in a background thread; see
    the module's docstring."""

    background = True

    def __init__(self, *args, max_tokens_per_round: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.budget = max_tokens_per_round
        self._flights: dict[int, Flight] = {}
        self._next_admit = 0
        self._first_version = 0
        self._versions_done = -1  # the last version whose calls are done
        self._failure: BaseException | None = None
        self._saved: dict[int, dict] = {}  # version -> what a checkpoint keeps after its calls

    def first(self, r: int) -> int:
        return max(0, r - self.max_staleness)

    def due(self, r: int) -> int:
        return max(0, r - min(self.max_staleness, 1))

    def generate_version(self, r: int) -> int:
        return self.due(r)  # dynamic sampling's draws are generated whole when the round is due

    def last_version(self) -> int:
        return self.due(self.last_round)

    # ------------------------------------------------------------------ the producer's contract

    def start(self, first_round: int = 0, ready: list[Round] = (), carried: dict | None = None) -> None:
        self.round_index = first_round
        for rnd in ready:
            self._future(rnd.index).set_result(rnd)
        if carried is not None:
            G = self.num_generations
            self._flights = {f["index"]: Flight.restore(f, self.rollouts, table_prompts(self.table, [i for i in f["indices"] for _ in range(G)]))
                             for f in carried["flights"]}  # fmt: skip
            self._next_admit = carried["next_admit"]
            self._first_version = carried["version"] + 1
            self._saved[carried["version"]] = carried  # a checkpoint before the next pass keeps it again
            self.sampler.load_state_dict(carried["sampler"])
        else:  # a fresh run, or a checkpoint of whole rounds: what is not generated is admitted afresh
            self._next_admit = first_round + len(ready)
            self._first_version = self.first(self._next_admit)
        self._versions_done = self._first_version - 1
        if self.background:
            self._thread.start()

    def _run(self) -> None:
        for v in range(self._first_version, self.last_version() + 1):
            with self._cv:
                self._cv.wait_for(lambda: self._live_version >= v or self._stopped)
                if self._stopped:
                    return
            try:
                self._version(v)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the trainer's thread
                with self._cv:
                    self._failure = exc
                    self._cv.notify_all()
                for r in range(self.round_index, self.last_round + 1):
                    future = self._future(r)
                    if not future.done():
                        future.set_exception(exc)
                return

    def wait_generated(self, r: int) -> None:
        """Return once the calls of version r - max_staleness are done (the last a round up to r
        is admitted at): the next version may go live."""
        v = self.first(r)
        if v > self.last_version():
            return
        with self._cv:
            if not self._cv.wait_for(lambda: self._versions_done >= v or self._failure is not None, timeout=self.round_timeout):
                raise RoundTimeout(f"waited {self.round_timeout:g}s for the calls of version {v} (partial rollouts) before the next "
                                   "weight push, longer than its generate calls and reward functions may take by their timeouts: "
                                   "a rollout server or a reward function is stuck")  # fmt: skip
            if self._failure is not None and self._versions_done < v:
                raise self._failure

    def _checkpoint_version(self, version: int) -> int | None:
        """The version whose end a checkpoint of the trainer's weights of `version` keeps: the one
        before, whose calls ended the round those weights trained last (waited for, as
        wait_generated would). Not the live one's: a push that failed left it a version behind
        (issue 73: a checkpoint after it held weights of v4 with sequences in flight as of v2).
        None where that version's calls never finished (they failed): nothing here matches."""
        v = min(version - 1, self.last_version())
        with self._cv:
            self._cv.wait_for(lambda: self._versions_done >= v or self._failure is not None, timeout=self.round_timeout)
            return v if self._versions_done >= v else None

    def checkpointable(self, version: int) -> bool:
        return self._checkpoint_version(version) is not None

    def _kept(self, version: int) -> int:
        v = self._checkpoint_version(version)
        if v is None:
            raise RuntimeError(f"partial rollouts: the calls of version {version - 1} never finished, so no checkpoint matches weights of version {version}")
        return v

    def pending(self, version: int) -> list[Round]:
        v = self._kept(version)
        out, r = [], self.round_index
        while r <= self.last_round and self.due(r) <= v:
            future = self._future(r)
            if not future.done() or future.exception() is not None:
                break
            out.append(future.result())
            r += 1
        return out

    def carried(self, version: int) -> dict | None:
        v = self._kept(version)
        with self._cv:
            return self._saved.get(v)

    # ------------------------------------------------------------------ generation

    def _version(self, v: int) -> None:
        """Admit the rounds whose first version is v, run v's calls, hand over the rounds due."""
        while self._next_admit <= self.last_round and self.first(self._next_admit) <= v:
            self._admit(self._next_admit)
            self._next_admit += 1
        due = [r for r in sorted(self._flights) if self.due(r) == v]
        owner = self._flights[due[0]] if due else next(iter(self._flights.values()))  # the calls' time and occupancy go to the round due
        self._call(v, [t for f in self._flights.values() for t in f.seqs if t.finish is None], self.budget, owner)
        ending = [t for r in due for t in self._flights[r].seqs]
        for _ in range(self.params.max_tokens + 1):  # each call ends a turn of every one, or finishes it
            if all(t.finish is not None for t in ending):
                break
            self._call(v, [t for t in ending if t.finish is None], self.params.max_tokens, owner)
        for r in due:
            flight = self._flights.pop(r)
            self._future(r).set_result(self._finish(flight))
        with self._cv:
            self._saved[v] = {
                "version": v,
                "next_admit": self._next_admit,
                "sampler": self.sampler.state_dict(),
                "flights": [f.saved() for f in self._flights.values()],
            }
            self._saved = {u: s for u, s in self._saved.items() if u >= v - 2}
            self._versions_done = v
            self._cv.notify_all()

    def _admit(self, r: int) -> None:
        indices, slots = self.sampler.next_round()
        G = self.num_generations
        prompts = table_prompts(self.table, [i for i in indices for _ in range(G)])
        seqs = [self.rollouts.begin(p, completion_seed(self.seed, r, slots[k // G], k % G)) for k, p in enumerate(prompts)]
        self._flights[r] = Flight(r, indices, slots, seqs, self.sampler.state_dict())

    def _call(self, v: int, live: list[Live], budget: int, owner: Flight) -> None:
        """One engine call: each of `live` decodes at most `budget` more tokens of its turn in
        progress, none past max_tokens; the turns that end run their tools."""
        if not live:
            return
        limit = self.params.max_tokens
        params = replace(self.params, max_tokens=min(budget, max(limit - len(t.ids) for t in live)))
        before = sum(len(t.ids) for t in live)
        t0 = time.perf_counter()
        outs = self.engine.generate([t.prompt_ids + t.ids for t in live], params, [turn_seed(t.seed, t.chunks) for t in live], min_version=v)
        owner.generate_seconds += time.perf_counter() - t0
        ended = [(t, text) for t, out in zip(live, outs) if (text := self.rollouts.take(t, out)) is not None]
        owner.occupancy_tokens += sum(len(t.ids) for t in live) - before
        owner.occupancy_slots += len(live) * max(len(o.token_ids) for o in outs)
        self.rollouts.respond(ended)

    def _finish(self, f: Flight) -> Round:
        """The round as the trainer gets it: its groups in the sampler's order, scored."""
        G = self.num_generations
        prompts = table_prompts(self.table, [i for i in f.indices for _ in range(G)])
        rollouts = [to_rollout(self.rollouts.finish(t), p, f.indices[k // G], self.group_id(f.index, f.slots[k // G]))
                    for k, (t, p) in enumerate(zip(f.seqs, prompts))]  # fmt: skip
        t = time.perf_counter()
        table, completions = self.score(rollouts, f.index)
        times = [f.generate_seconds, time.perf_counter() - t]  # generate, reward
        dropped = resampled = 0
        if self.max_resample_times is not None:  # new groups replace agreeing ones, generated whole at this version
            rollouts, table, completions, dropped, resampled = self._resample(f.index, rollouts, table, completions, times)
        occupancy = f.occupancy_tokens / f.occupancy_slots if f.occupancy_slots else None
        return Round(f.index, rollouts, table, completions, times[0], times[1], f.sampler_state, dropped_groups=dropped,
                     resampled_completions=resampled, occupancy=occupancy, reward_metrics=self.reward_metrics.pop(f.index, {}))  # fmt: skip


class SyncPartialProducer(PartialProducer):
    """Partial rollouts where generation does not overlap training (colocated, or a server in
    sync mode): asked for round r, the trainer's thread first runs the calls of every version up
    to the live one, while those weights are the engine's; the rounds, versions and tokens are
    those of the background producer's run."""

    background = False

    def next_round(self) -> Round:
        t = time.perf_counter()
        for v in range(self._versions_done + 1, min(self._live_version, self.last_version()) + 1):
            self._version(v)
        rnd = super().next_round()
        rnd.wait_seconds = time.perf_counter() - t  # the trainer waited for those calls
        return rnd
