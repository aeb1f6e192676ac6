"""The rollout producer: turns the sampler's next prompts into scored Rollout records.

Round r is generated with policy version max(0, r - max_staleness), exactly. The synchronous
producer generates round r when the trainer asks for it (max_staleness 0). The asynchronous
producer generates rounds ahead in a background thread, admitting round r once version
r - max_staleness is live; the trainer makes version v + 1 live only after round
v + max_staleness has been generated (wait_generated), so no round ever sees a newer version
than its own and a run is reproducible whatever the timing. The thread does HTTP and reward
scoring only, never a collective. Partial rollouts (partial.py) generate the same rounds in
calls of a token budget across versions.
"""

import math
import threading
import time
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field

import torch

from tandem import rewards as rewards_lib
from tandem.algo import zero_std_groups
from tandem.data import GroupSampler
from tandem.engines.engine import Engine
from tandem.rollout.multiturn import Prompt, Rollouts, SingleTurn, Trajectory
from tandem.rollout.sampling import mix64
from tandem.rollout.types import Rollout, SamplingParams

def completion_seed(seed: int, round_index: int, slot: int, generation: int) -> int:
    """Seed of one completion, from where it sits in the run, not from which rank or batch made it."""
    return mix64(mix64(mix64(mix64(seed) ^ round_index) ^ slot) ^ generation)


@dataclass
class PromptTable:
    """The dataset after prompt encoding: what the producer needs of each row."""

    prompts: list  # the raw prompt (str or messages), as reward functions receive it
    prompt_ids: list[list[int]]
    columns: dict[str, list]  # every other dataset column
    conversational: list[bool]


@dataclass
class Round:
    index: int
    rollouts: list[Rollout]  # this rank's, its groups contiguous: (B_rank * G)
    rewards: torch.Tensor  # (N_rank, F), NaN where a function returned None
    completions: list  # decoded completions as the reward functions saw them
    generate_seconds: float
    reward_seconds: float
    sampler_state: dict  # the sampler right after this round took its prompts
    wait_seconds: float = 0.0  # how long the trainer sat waiting for this round
    dropped_groups: int = 0  # dynamic sampling: groups of agreeing rewards left out of the round
    resampled_completions: int = 0  # dynamic sampling: completions generated to replace them
    occupancy: float | None = None  # of the engine: tokens kept / (sequences x decode steps) of the round's calls
    reward_metrics: dict = field(default_factory=dict)  # name -> values reward functions gave log_metric (TRL's), this rank's

    def to_dict(self) -> dict:
        """JSON-ready (floats round-trip exactly through JSON; NaN rewards become null)."""
        return {
            "index": self.index,
            "rollouts": [asdict(r) for r in self.rollouts],
            "rewards": [[None if math.isnan(v) else v for v in row] for row in self.rewards.tolist()],
            "completions": self.completions,
            "generate_seconds": self.generate_seconds,
            "reward_seconds": self.reward_seconds,
            "sampler_state": self.sampler_state,
            "dropped_groups": self.dropped_groups,
            "resampled_completions": self.resampled_completions,
            "occupancy": self.occupancy,
            "reward_metrics": self.reward_metrics,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Round":
        rewards = torch.tensor([[math.nan if v is None else v for v in row] for row in d["rewards"]], dtype=torch.float32)
        return cls(
            d["index"], [Rollout(**r) for r in d["rollouts"]], rewards, d["completions"],
            d["generate_seconds"], d["reward_seconds"], d["sampler_state"],
            dropped_groups=d.get("dropped_groups", 0), resampled_completions=d.get("resampled_completions", 0), occupancy=d.get("occupancy"),
            reward_metrics=d.get("reward_metrics", {}),
        )  # fmt: skip


class SyncProducer:
    """Generates and scores round r when the trainer asks, with the weights live at that moment."""

    def __init__(
        self,
        table: PromptTable,
        sampler: GroupSampler,
        engine: Engine,
        tokenizer,
        reward_fns: list[rewards_lib.NamedReward],
        params: SamplingParams,
        num_generations: int,
        seed: int,
        max_staleness: int = 0,
        max_resample_times: int | None = None,
        rollouts: Rollouts | None = None,
        steps: tuple[int, int] = (1, 0),
    ):
        self.table = table
        self.sampler = sampler
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward_fns = reward_fns
        self.params = params
        self.num_generations = num_generations
        self.seed = seed
        self.max_staleness = max_staleness
        self.max_resample_times = max_resample_times  # None: no dynamic sampling
        self.rollouts = rollouts or SingleTurn()  # one completion per prompt, or turns with tools
        self.steps = steps  # (optimizer steps a round, max_steps): the trainer_state reward functions get
        self.reward_metrics: dict[int, dict] = {}  # round -> what its reward functions gave log_metric, until the round is made
        self.round_index = 0  # the next round the trainer will get
        self._ready: dict[int, Round] = {}

    def start(self, first_round: int = 0, ready: list[Round] = (), carried: dict | None = None) -> None:
        """Begin at round first_round; `ready` are rounds already generated (from a checkpoint)."""
        self.round_index = first_round
        self._ready = {rnd.index: rnd for rnd in ready}

    def pending(self, version: int) -> list[Round]:
        """Rounds generated but not yet handed to the trainer, in order, for a checkpoint of the
        trainer's weights of `version`."""
        return []

    def carried(self, version: int) -> dict | None:
        """Sequences in flight between rounds, for a checkpoint of the trainer's weights of
        `version` (partial rollouts; None here)."""
        return None

    def checkpointable(self, version: int) -> bool:
        """Whether what pending() and carried() give matches the trainer's weights of `version`
        (after a failure it may not: partial rollouts whose last calls never finished)."""
        return True

    def next_round(self) -> Round:
        if self.round_index in self._ready:
            rnd = self._ready.pop(self.round_index)
            self.round_index += 1
            return rnd
        t = time.perf_counter()
        rnd = self._make_round(self.round_index)
        self.round_index += 1
        rnd.wait_seconds = time.perf_counter() - t
        return rnd

    def set_live_version(self, version: int) -> None:
        """The trainer's weights of `version` are live on the engine."""

    def wait_generated(self, r: int) -> None:
        """Return once round r is generated (the synchronous producer generates on demand)."""

    def close(self, ok: bool = True) -> None:
        self.rollouts.close()

    def _make_round(self, r: int) -> Round:
        indices, slots = self.sampler.next_round()
        times = [0.0, 0.0]  # generate, reward
        rollouts, table, completions = self._generate(r, indices, slots, times)
        dropped = resampled = 0
        if self.max_resample_times is not None:
            rollouts, table, completions, dropped, resampled = self._resample(r, rollouts, table, completions, times)
        longest = max(ro.model_tokens for ro in rollouts)
        single = isinstance(self.rollouts, SingleTurn)  # one engine call per round (or its resamples): its batch's occupancy
        occupancy = sum(ro.model_tokens for ro in rollouts) / (len(rollouts) * longest) if longest and single else None
        return Round(r, rollouts, table, completions, times[0], times[1], self.sampler.state_dict(), dropped_groups=dropped,
                     resampled_completions=resampled, occupancy=occupancy, reward_metrics=self.reward_metrics.pop(r, {}))  # fmt: skip

    def _generate(self, r: int, indices: list[int], slots: list[int], times: list[float]) -> tuple[list[Rollout], torch.Tensor, list]:
        """The G completions of each prompt, scored; their seeds come from (round, slot)."""
        G = self.num_generations
        prompts = table_prompts(self.table, [i for i in indices for _ in range(G)])
        seeds = [completion_seed(self.seed, r, s, g) for s in slots for g in range(G)]
        t0 = time.perf_counter()
        trajectories = self.rollouts.generate(self.engine, prompts, self.params, seeds, self.generate_version(r))
        t1 = time.perf_counter()
        rollouts = [to_rollout(t, prompts[k], indices[k // G], self.group_id(r, slots[k // G])) for k, t in enumerate(trajectories)]
        table, completions = self.score(rollouts, r)
        times[0] += t1 - t0
        times[1] += time.perf_counter() - t1
        return rollouts, table, completions

    def generate_version(self, r: int) -> int:
        """The version round r's whole generate calls are made at (the least the engine may serve)."""
        return max(0, r - self.max_staleness)

    def group_id(self, r: int, slot: int) -> int:
        """A group's id, unique in the run: its round and its slot, resampled slots included."""
        return r * self.sampler.prompts_per_rank * self.sampler.world_size * (1 + (self.max_resample_times or 0)) + slot

    def _resample(self, r: int, rollouts: list[Rollout], table: torch.Tensor, completions: list, times: list[float]):
        """DAPO's dynamic sampling: groups whose rewards all agree are replaced by groups of new
        prompts, up to max_resample_times draws; a round still short then takes back the first
        dropped groups, so every rank trains on its full number of groups.

        Each rank resamples on its own (no collective: this may run in the producer's thread).
        Draw k of round r on rank q takes prompts at random from the whole dataset, seeded by
        (seed, r, q, k), and slots past the round's, so nothing depends on timing or on the
        sampler's stream: a resumed or async run draws the same prompts and completions.
        """
        G, B, world = self.num_generations, self.sampler.prompts_per_rank, self.sampler.world_size
        weights = [f.weight for f in self.reward_fns]
        groups = _split_groups(rollouts, table, completions, G)
        zero = zero_std_groups(rewards_lib.combine(table, weights), G).tolist()
        kept = [g for g, z in zip(groups, zero) if not z]
        dropped = [g for g, z in zip(groups, zero) if z]
        resampled = 0
        for draw in range(self.max_resample_times):
            need = B - len(kept)
            if need == 0:
                break
            gen = torch.Generator().manual_seed(completion_seed(self.seed, r, self.sampler.rank, draw) & (2**63 - 1))
            indices = torch.randperm(len(self.table.prompt_ids), generator=gen)[:need].tolist()
            indices = (indices * need)[:need]  # a dataset smaller than the need repeats its prompts
            slots = [(1 + draw) * B * world + self.sampler.rank * B + j for j in range(need)]
            new = _split_groups(*self._generate(r, indices, slots, times), G)
            resampled += need * G
            new_zero = zero_std_groups(rewards_lib.combine(torch.cat([g[1] for g in new]), weights), G).tolist()
            kept += [g for g, z in zip(new, new_zero) if not z]
            dropped += [g for g, z in zip(new, new_zero) if z]
        refill = dropped[: B - len(kept)]
        kept += refill
        out_rollouts = [ro for g in kept for ro in g[0]]
        return out_rollouts, torch.cat([g[1] for g in kept]), [c for g in kept for c in g[2]], len(dropped) - len(refill), resampled

    def score(self, rollouts: list[Rollout], r: int) -> tuple[torch.Tensor, list]:
        """Round r's rewards. Reward functions get TRL's trainer_state as of the round's first
        step: the steps trained before it, whenever it is scored (async: ahead), so that a reward
        shaped by training progress is the same in every mode and run."""
        from transformers import TrainerState

        per_round, max_steps = self.steps
        state = TrainerState(global_step=r * per_round, max_steps=max_steps)
        table, completions, metrics = score_rollouts(self.table, self.tokenizer, self.reward_fns, self.params.max_tokens, rollouts, trainer_state=state)
        logged = self.reward_metrics.setdefault(r, {})
        for name, values in metrics.items():
            logged.setdefault(name, []).extend(values)
        return table, completions


def table_prompts(table: PromptTable, rows: list[int]) -> list[Prompt]:
    return [Prompt(table.prompt_ids[i], table.prompts[i], {c: v[i] for c, v in table.columns.items()}) for i in rows]


def to_rollout(t: Trajectory, prompt: Prompt, prompt_index: int, group_id: int) -> Rollout:
    return Rollout(
        prompt_index=prompt_index,
        group_id=group_id,
        prompt_ids=t.prompt_ids or prompt.ids,
        completion_ids=t.token_ids,
        behav_logprobs=t.logprobs,
        finish_reason=t.finish_reason,
        version=t.version,
        loss_mask=t.loss_mask,
        turns=t.info,
        token_versions=t.token_versions,
        earlier=t.earlier,
    )


def score_rollouts(table: PromptTable, tokenizer, reward_fns: list[rewards_lib.NamedReward], max_tokens: int, rollouts: list[Rollout],
                   **more) -> tuple[torch.Tensor, list, dict]:  # fmt: skip
    """Every rollout's rewards (N, F), its completion as the reward functions saw it (a message
    list for a conversational prompt, else text), and what they gave log_metric; the prompt's
    other columns and `more` (trainer_state) as keywords. What they gave log_extra goes on each
    rollout (Rollout.logged)."""
    log = rewards_lib.RewardLog(len(rollouts))
    texts = tokenizer.batch_decode([ro.completion_ids for ro in rollouts], skip_special_tokens=True)
    completions = [_completion(table, ro, t) for ro, t in zip(rollouts, texts)]
    rows = [ro.prompt_index for ro in rollouts]
    columns = {name: [values[i] for i in rows] for name, values in table.columns.items()}
    if any(ro.turns for ro in rollouts):
        columns["environment_reward"] = [ro.turns["environment_reward"] for ro in rollouts]
    scores = rewards_lib.score(
        reward_fns,
        prompts=[table.prompts[i] for i in rows],
        completions=completions,
        completion_ids=[ro.completion_ids for ro in rollouts],
        max_completion_length=max_tokens,
        **columns,
        log=log,
        **more,
    )
    for ro, logged in zip(rollouts, log.rows()):
        ro.logged = logged or None
    scores[[bool(ro.turns and ro.turns.get("zero_reward")) for ro in rollouts]] = 0.0  # a failed agent's, with agent_failure zero
    scores[[ro.failed for ro in rollouts]] = float("nan")  # an unfinished text earns nothing: see Rollout.failed
    return scores, completions, log.metrics


def _completion(table: PromptTable, ro: Rollout, text: str):
    """A completion as reward functions get it (TRL's convention): a multi-turn trajectory's
    messages after the prompt (its turns, tool calls and tool results), one assistant message
    for a chat prompt, else the text."""
    if ro.turns and ro.turns["messages"]:
        return ro.turns["messages"]
    return [{"role": "assistant", "content": text}] if table.conversational[ro.prompt_index] else text


def _split_groups(rollouts: list[Rollout], table: torch.Tensor, completions: list, G: int) -> list[tuple]:
    """(rollouts, rewards (G, F), completions) of each group, in order."""
    return [(rollouts[i : i + G], table[i : i + G], completions[i : i + G]) for i in range(0, len(rollouts), G)]


class RoundTimeout(RuntimeError):
    """A round took longer than it legitimately can (its generation, with retries, and its rewards)."""


class AsyncProducer(SyncProducer):
    """Generates rounds ahead of the trainer in one background thread.

    Round r is admitted once version r - max_staleness is live, so at most max_staleness + 1
    rounds are ahead and no finished round is ever thrown away. Rounds are produced in order
    from the same sampler as the synchronous producer, so both see the same prompts in the same
    order. A failure in the thread (server down, bad response, reward crash) is stored in that
    round's future and raised in the trainer's thread by next_round, with its cause.
    """

    def __init__(self, *args, round_timeout: float | None, last_round: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.round_timeout = round_timeout
        # No round past the run's last is generated: it would be thrown away, and a thread still
        # in a request at exit meets the interpreter's shutdown (see close).
        self.last_round = last_round
        self.join_timeout = 10.0  # seconds close() waits for a thread that is still in a request
        self._cv = threading.Condition()
        self._live_version = 0
        self._futures: dict[int, Future] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="tandem-producer", daemon=True)

    def start(self, first_round: int = 0, ready: list[Round] = (), carried: dict | None = None) -> None:
        self.round_index = first_round
        for rnd in ready:
            self._future(rnd.index).set_result(rnd)
        self._first_to_generate = first_round + len(ready)
        self._thread.start()

    def pending(self, version: int) -> list[Round]:
        out, r = [], self.round_index
        while True:
            with self._cv:
                future = self._futures.get(r)
            if future is None or not future.done() or future.exception() is not None:
                return out
            out.append(future.result())
            r += 1

    def _future(self, r: int) -> Future:
        with self._cv:
            return self._futures.setdefault(r, Future())

    def _run(self) -> None:
        r = self._first_to_generate
        while r <= self.last_round:
            with self._cv:
                self._cv.wait_for(lambda: self._live_version >= r - self.max_staleness or self._stopped)
                if self._stopped:
                    return
            future = self._future(r)
            try:
                future.set_result(self._make_round(r))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the trainer's thread by next_round
                future.set_exception(exc)
                return
            r += 1

    def next_round(self) -> Round:
        r = self.round_index
        t = time.perf_counter()
        try:
            rnd = self._future(r).result(timeout=self.round_timeout)
        except FutureTimeout:
            raise RoundTimeout(
                f"waited {self.round_timeout:g}s for round {r} to be generated and scored (live version {self._live_version}, "
                f"max_staleness {self.max_staleness}), longer than its generate calls and reward functions may take by their "
                "timeouts: a rollout server or a reward function is stuck"
            ) from None
        with self._cv:
            self._futures.pop(r, None)
        self.round_index += 1
        rnd.wait_seconds = time.perf_counter() - t
        return rnd

    def set_live_version(self, version: int) -> None:
        with self._cv:
            self._live_version = version
            self._cv.notify_all()

    def wait_generated(self, r: int) -> None:
        if r < self.round_index or r > self.last_round:
            return  # already handed to the trainer, or never to be generated
        future = self._future(r)
        if not wait([future], timeout=self.round_timeout).done:
            raise RoundTimeout(
                f"waited {self.round_timeout:g}s for round {r} to be generated and scored before the next weight push, longer "
                "than its generate calls and reward functions may take by their timeouts: a rollout server or a reward function is stuck"
            )
        future.result()  # raises the round's failure, if any

    def close(self, ok: bool = True) -> None:
        """Stop the thread and wait for it. A thread still running when the interpreter shuts
        down is killed wherever it is; inside a torch call that aborts the process
        ("terminate called without an active exception") after a run that succeeded. At the end
        of a run the thread is idle (it stops at last_round), so the join returns at once. After
        a failure (not `ok`) it may be in a request, which a stopped server can hold for
        rollout_request_timeout: the wait is short, and the thread and the client's request
        threads are daemons, so the process exits within seconds."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=self.join_timeout if ok else 2.0)
        self.rollouts.close()
