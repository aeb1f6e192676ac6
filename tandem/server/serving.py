"""The rollout server's logic, apart from HTTP: request batching, the version gate, atomic
versioned weight updates. It depends only on the engine interface."""

import asyncio
import logging
import math
import os
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from tandem.engines.engine import Engine
from tandem.rollout.types import Completion, SamplingParams
from tandem.rollout.adapters import check_adapter, check_pairs, merge
from tandem.rollout.weights import apply_xor, check_weights, decompress_delta, fingerprint, max_update_bytes


class NotReady(RuntimeError):
    """The engine is still loading."""


class VersionConflict(RuntimeError):
    """A version the server cannot serve or accept."""


class OtherProcess(RuntimeError):
    """A request meant for another process of this server: the one its client synced is gone."""


class UnknownUpdate(KeyError):
    """A weight-update id the server does not hold."""


class Busy(RuntimeError):
    """A bounded resource (version waiters) is full; the client should retry later."""


class TooLarge(ValueError):
    """A weight chunk larger than what its update can still hold."""


class EngineFailure(RuntimeError):
    """The engine returned something the server will not pass on (non-finite log-probs)."""


log = logging.getLogger("tandem")
# How long a run's hold on the server lasts without renewal (`tandem rollout --run-lease`): its
# trainer renews it every quarter of this; a trainer that died frees the server after it.
RUN_LEASE_SECONDS = 60.0


class HeldByAnotherRun(RuntimeError):
    """The server serves another training run: two runs' weight pushes would interleave."""


@dataclass
class RunHold:
    """The training run whose weights the server serves: only it may push."""

    run_id: str
    name: str  # where the run is (its output_dir, host and pid), for the refusal's message
    since: float  # time.time() of its first claim
    expires: float = math.inf  # time.monotonic() past which, not renewed, another run may take the server
    threads: int | None = None  # CPU threads the run lends the engine's calls (its trainer waits while they run)


@dataclass
class _Job:
    prompts: list[list[int]]
    seeds: list[int]
    params: SamplingParams
    tokens: int
    future: Future = field(default_factory=Future)


@dataclass
class _Staged:
    version: int
    force: bool
    num_tensors: int
    capacity: int  # bytes this update may still receive: the model's size in F32, less what arrived or is on its way
    adapter: bool = False  # LoRA factors to merge into the base weights (tandem.rollout.adapters)
    delta_from: int | None = None  # a delta update: XORs against the weights of this version (the delta base)
    keep_base: bool = False  # these weights become the delta base once live
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class _Gate:
    """Many holders of the shared side (engine calls) or one of the exclusive side (a weight
    commit). A waiting commit keeps new calls out, so a stream of requests cannot starve it."""

    def __init__(self):
        self._cv = threading.Condition()
        self._shared = 0
        self._exclusive_waiting = 0
        self._exclusive = False

    @contextmanager
    def shared(self):
        with self._cv:
            self._cv.wait_for(lambda: not self._exclusive and not self._exclusive_waiting)
            self._shared += 1
        try:
            yield
        finally:
            with self._cv:
                self._shared -= 1
                self._cv.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cv:
            self._exclusive_waiting += 1
            self._cv.wait_for(lambda: not self._exclusive and not self._shared)
            self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cv:
                self._exclusive = False
                self._cv.notify_all()


class RolloutService:
    """Owns one engine. A dispatcher thread hands requests to the engine, at most
    engine.max_concurrency calls at a time: while those are busy, waiting requests with the same
    sampling parameters are merged into one call of at most max_batch_tokens (prompt plus
    max_tokens per sequence), oldest first, so no client starves. A weight commit waits for the
    calls in flight and keeps new ones out until it is done, so no completion mixes two versions."""

    def __init__(self, max_batch_tokens: int = 65536, max_model_len: int = 4096, vocab_size: int = 0, max_version_waiters: int = 256,
                 run_lease: float = RUN_LEASE_SECONDS, fixed_threads: bool = False):  # fmt: skip
        """`fixed_threads` (`--threads` given): engine calls keep the process's torch threads,
        whatever threads a run lends."""
        self.engine: Engine | None = None
        self.run_lease = run_lease  # seconds a run's hold lasts past its last claim (the trainer renews it)
        self.fixed_threads = fixed_threads
        self._own_threads = torch.get_num_threads()
        self.max_batch_tokens = max_batch_tokens
        self.max_version_waiters = max_version_waiters
        self._waiters = 0  # requests waiting for min_version; they hold no thread
        self._version_events: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._gate = _Gate()  # engine calls share it, a weight commit holds it alone
        self._cv = threading.Condition()  # guards _pending, _staged, _running, and signals version changes
        self._pending: deque[_Job] = deque()
        self._running = 0  # engine calls in flight
        self._calls: ThreadPoolExecutor | None = None
        self._staged: dict[str, _Staged] = {}
        # While an adapter is live: the full weights it is merged into, their fingerprint, and the adapter's.
        self._base: tuple[dict[str, torch.Tensor], str] | None = None
        self._adapter_fingerprint: str | None = None
        # The live weights a delta update applies to, as an update with keep_base sent them, and their version.
        self._delta_base: tuple[int, dict[str, torch.Tensor]] | None = None
        self._stopped = False
        self._broken: str | None = None  # why the engine's weights are mixed: an update failed midway
        self.run: RunHold | None = None  # the run that holds the server, if one claimed it
        # prompt_tokens: of the sequences generated; cached_prompt_tokens: those of them the
        # engine's prefix cache served (a multi-turn trajectory's earlier turns, for one)
        self.stats = {"requests": 0, "engine_calls": 0, "sequences": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0}
        self.instance_id = uuid.uuid4().hex
        self._worker = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ lifecycle

    def set_engine(self, engine: Engine, vocab_size: int, max_model_len: int) -> None:
        with self._cv:
            self._calls = ThreadPoolExecutor(engine.max_concurrency, thread_name_prefix="tandem-engine-call")
            self.engine, self.vocab_size, self.max_model_len = engine, vocab_size, max_model_len
            self._cv.notify_all()

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def version(self) -> int:
        return self.engine.version if self.engine is not None else 0

    def _need_engine(self) -> Engine:
        if self.engine is None:
            raise NotReady("the model is still loading; retry when /health says ready")
        return self.engine

    def stop(self) -> None:
        with self._cv:
            if self._stopped:
                return
            self._stopped = True
            self._cv.notify_all()
        self._worker.join(timeout=5)
        if self._calls is not None:
            self._calls.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            self.engine.close()

    # ------------------------------------------------------------------ generation

    async def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, seeds: list[int], min_version: int, version_timeout: float,
        instance_id: str | None = None,
    ) -> list[Completion]:
        """Completions (prompt-major, n per prompt), each stating the version that generated it.
        Waiting for min_version and for the engine holds no thread: a crowd of waiting requests
        cannot stall health checks or weight updates. `instance_id`: the process the client
        synced; another one refuses at once, where it would wait for a version only that
        client's resync can give it."""
        if instance_id is not None and instance_id != self.instance_id:
            raise OtherProcess(f"this request is for the server process {instance_id}, but this is {self.instance_id}: the server restarted "
                               "and holds none of the weights that process was given; sync it again (GET /health names the process)")  # fmt: skip
        self._need_engine()
        if self._broken:
            raise EngineFailure(self._broken)
        self._check(prompts, n, params, seeds)
        await self._wait_for_version(min_version, version_timeout)
        sequences = [p for p in prompts for _ in range(n)]
        jobs = self._split(sequences, seeds, params)
        with self._cv:
            self.stats["requests"] += 1
            self._pending.extend(jobs)
            self._cv.notify_all()
        results: list[Completion] = []
        for job in jobs:
            results += await asyncio.wrap_future(job.future)
        return results

    async def _wait_for_version(self, min_version: int, timeout: float) -> None:
        if self.version >= min_version:
            return
        if self._waiters >= self.max_version_waiters:
            raise Busy(f"{self._waiters} requests already wait for a version (the limit, --max-version-waiters); retry later")
        self._waiters += 1
        deadline = time.monotonic() + timeout
        try:
            while self.version < min_version:
                event = asyncio.Event()
                self._version_events.append((asyncio.get_running_loop(), event))
                if self.version >= min_version:  # a commit between the check and the registration
                    break
                remaining = deadline - time.monotonic()
                try:
                    await asyncio.wait_for(event.wait(), timeout=max(remaining, 0))
                except TimeoutError:
                    raise VersionConflict(
                        f"min_version {min_version} is not live: the server is at version {self.version} "
                        f"and waited version_timeout={timeout}s for it"
                    ) from None
        finally:
            self._waiters -= 1

    def _version_changed(self) -> None:
        """Wake every request waiting for a version (called from the thread that committed)."""
        events, self._version_events = self._version_events, []
        for loop, event in events:
            loop.call_soon_threadsafe(event.set)

    def _check(self, prompts, n, params: SamplingParams, seeds) -> None:
        params.validate()
        if len(seeds) != len(prompts) * n:
            raise ValueError(f"seeds: got {len(seeds)}, need len(prompts) * n = {len(prompts) * n} (one per completion)")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ValueError(f"prompts[{i}] has a token id outside [0, {self.vocab_size}) (the model's vocabulary)")
            if len(p) + params.max_tokens > self.max_model_len:
                raise ValueError(
                    f"prompts[{i}]: {len(p)} prompt tokens + max_tokens {params.max_tokens} exceed the model's "
                    f"max_model_len {self.max_model_len}"
                )

    def _split(self, sequences, seeds, params: SamplingParams) -> list[_Job]:
        """Cut a request into jobs of at most max_batch_tokens (at least one sequence each)."""
        jobs, cur, cur_seeds, tokens = [], [], [], 0
        for p, s in zip(sequences, seeds):
            cost = len(p) + params.max_tokens
            if cur and tokens + cost > self.max_batch_tokens:
                jobs.append(_Job(cur, cur_seeds, params, tokens))
                cur, cur_seeds, tokens = [], [], 0
            cur.append(p)
            cur_seeds.append(s)
            tokens += cost
        jobs.append(_Job(cur, cur_seeds, params, tokens))
        return jobs

    def _take_batch(self) -> list[_Job]:
        """The oldest job, plus later jobs with the same sampling parameters that still fit."""
        head = self._pending.popleft()
        batch, tokens, keep = [head], head.tokens, deque()
        while self._pending:
            job = self._pending.popleft()
            if job.params == head.params and tokens + job.tokens <= self.max_batch_tokens:
                batch.append(job)
                tokens += job.tokens
            else:
                keep.append(job)
        self._pending = keep
        return batch

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(
                    lambda: (self._pending and self.engine is not None and self._running < self.engine.max_concurrency) or self._stopped
                )
                if self._stopped:
                    for job in self._pending:
                        job.future.set_exception(RuntimeError("the rollout server is shutting down"))
                    return
                batch = self._take_batch()
                self._running += 1
                self.stats["engine_calls"] += 1
                self.stats["sequences"] += sum(len(job.prompts) for job in batch)
            self._calls.submit(self._call, batch)

    def _call(self, batch: list[_Job]) -> None:
        prompts = [p for job in batch for p in job.prompts]
        seeds = [s for job in batch for s in job.seeds]
        with self._cv:
            lent = None if self.run is None or self.fixed_threads else self.run.threads
        # Set in this thread, at every call: torch.set_num_threads reaches MKL only in the thread
        # that calls it, so a new thread's large matmuls ran on every core whatever --threads said.
        torch.set_num_threads(lent or self._own_threads)
        try:
            with self._gate.shared():
                outs = self.engine.generate(prompts, batch[0].params, seeds)
        except Exception as exc:  # noqa: BLE001 - handed to every waiting request, not swallowed
            if not isinstance(exc, (ValueError, EngineFailure)):  # not the request's fault: a 500 that says what broke
                exc = EngineFailure(f"the engine failed: {type(exc).__name__}: {exc}")
            for job in batch:
                job.future.set_exception(exc)
            return
        finally:
            with self._cv:
                self._running -= 1
                self._cv.notify_all()
        with self._cv:
            self.stats["prompt_tokens"] += sum(len(p) for p in prompts)
            self.stats["cached_prompt_tokens"] += sum(c.cached_tokens for c in outs)
        bad = next((i for i, c in enumerate(outs) if not all(math.isfinite(x) for x in c.logprobs)), None)
        start = 0
        for job in batch:
            if bad is not None:  # JSON has no NaN: a null log-prob would break every client's parser
                job.future.set_exception(EngineFailure(f"the engine produced a non-finite log-prob (sequence {bad} of its batch)"))
            else:
                job.future.set_result(outs[start : start + len(job.prompts)])
            start += len(job.prompts)

    # ------------------------------------------------------------------ the run it serves

    def claim(self, run_id: str, name: str, threads: int | None = None) -> RunHold:
        """The run `run_id` holds the server for run_lease seconds more, unless another one holds
        it (a restarted trainer of the holding run, resuming, is let back in). A hold is a lease
        its trainer renews: one whose trainer died (killed, crashed without letting go) lapses,
        and the next run takes the server. `threads`: CPU threads the run lends the engine's
        calls while it holds the server (a trainer on this host that waits while they run), at
        most this process's cores; None leaves them at the process's own."""
        with self._cv:
            now = time.monotonic()
            if self.run is not None and self.run.run_id != run_id:
                if now < self.run.expires:
                    raise HeldByAnotherRun(self._held_message())
                log.info(f"the run {self.run.name} did not renew its hold for {self.run_lease:g}s: {name} takes the server")
                self.run = None
            if self.run is None:
                self.run = RunHold(run_id, name, time.time())
            self.run.name, self.run.expires = name, now + self.run_lease
            self.run.threads = None if threads is None else min(threads, len(os.sched_getaffinity(0)))
            return self.run

    def release(self, run_id: str | None) -> None:
        """The holding run lets go (at its end); without a run_id, whatever run holds it."""
        with self._cv:
            if self.run is not None and run_id in (None, self.run.run_id):
                self.run = None

    def _held_message(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.run.since))
        return (
            f"this server serves the run {self.run.name} since {since}: one server serves one run, or the two runs' weight "
            f"pushes would interleave. Give this run a server of its own, or stop that run; a run that is gone lets it go by "
            f"itself {self.run_lease:g}s after its last renewal (or free it now: DELETE /run, e.g. `curl -X DELETE URL/run`)"
        )

    # ------------------------------------------------------------------ weights

    def begin_update(self, version: int, force: bool, num_tensors: int, adapter: bool = False, run_id: str | None = None, delta_from: int | None = None,
                     keep_base: bool = False) -> str:  # fmt: skip
        engine = self._need_engine()
        with self._cv:
            if self.run is not None and run_id != self.run.run_id:
                raise HeldByAnotherRun(self._held_message())
        if not force and version != engine.version + 1:
            raise VersionConflict(f"update to version {version} refused: the server is at {engine.version}, the next is {engine.version + 1}")
        if adapter and (delta_from is not None or keep_base):
            raise ValueError("an adapter update cannot be a delta update or a delta base; send adapters whole")
        if delta_from is not None and (self._delta_base is None or self._delta_base[0] != delta_from or engine.version != delta_from):
            held = "no delta base" if self._delta_base is None else f"version {self._delta_base[0]} as its delta base"
            raise VersionConflict(f"a delta update against version {delta_from} refused: the server is at version {engine.version} and holds {held}; send a full update")
        update_id = uuid.uuid4().hex
        capacity = max_update_bytes(engine.weight_spec())
        with self._cv:  # an unfinished older update is dropped
            self._staged = {update_id: _Staged(version, force, num_tensors, capacity, adapter, delta_from, keep_base)}
        return update_id

    def reserve(self, update_id: str, nbytes: int) -> None:
        """Before a chunk's body is read: the update must exist and have room for nbytes more.
        So no request can make the server allocate more than the model's own size."""
        self._need_engine()  # a process still loading holds no update: 503, which clients retry
        with self._cv:
            staged = self._staged.get(update_id)
            if staged is None:
                raise UnknownUpdate(f"no weight update {update_id!r} in progress (a newer one replaced it, or it was committed)")
            if nbytes > staged.capacity:
                raise TooLarge(f"a chunk of {nbytes} bytes exceeds the {staged.capacity} bytes this update can still hold (the model in F32)")
            staged.capacity -= nbytes

    def unreserve(self, update_id: str, nbytes: int) -> None:
        """A reserved chunk that did not arrive gives its room back."""
        with self._cv:
            staged = self._staged.get(update_id)
            if staged is not None:
                staged.capacity += nbytes

    @contextmanager
    def reserved(self, update_id: str, nbytes: int):
        """reserve(), for a chunk staged in the block: a chunk refused or cut off there gives its
        room back."""
        self.reserve(update_id, nbytes)
        try:
            yield
        except BaseException:
            self.unreserve(update_id, nbytes)
            raise

    def stage(self, update_id: str, tensors: dict[str, torch.Tensor]) -> int:
        """Hold tensors of an update aside; nothing is live until commit. Returns tensors staged so far."""
        engine = self._need_engine()
        staged = self._update(update_id)
        if staged.delta_from is not None:
            raise ValueError(f"update {update_id} is a delta update: its chunks go to /weights/{update_id}/delta")
        if staged.adapter:  # early: a bad chunk fails as it arrives
            check_adapter(engine.weight_spec(), tensors)
        else:
            check_weights(engine.weight_spec(), tensors, complete=False)
        return self._add(update_id, staged, tensors)

    def stage_delta(self, update_id: str, body: bytes) -> int:
        """Stage the weights a delta chunk makes: its XORs (weights.compress_delta) applied to the
        delta base. Returns tensors staged so far."""
        engine = self._need_engine()
        staged = self._update(update_id)
        if staged.delta_from is None:
            raise ValueError(f"update {update_id} is a full update: its chunks go to /weights/{update_id}/chunk")
        base = self._delta_base[1] if self._delta_base is not None and self._delta_base[0] == staged.delta_from else None
        if base is None:
            raise VersionConflict(f"the delta base of update {update_id} (version {staged.delta_from}) is gone; send a full update")
        tensors = {}
        for name, delta in decompress_delta(body).items():
            old = base.get(name)
            if old is None or delta.shape != old.shape or delta.element_size() != old.element_size() or delta.is_floating_point():
                raise ValueError(f"delta for {name!r}: needs integer XORs of the shape and item size of the weight it changes")
            tensors[name] = apply_xor(old, delta)
        check_weights(engine.weight_spec(), tensors, complete=False)
        return self._add(update_id, staged, tensors)

    def _update(self, update_id: str) -> _Staged:
        with self._cv:
            staged = self._staged.get(update_id)
        if staged is None:
            raise UnknownUpdate(f"no weight update {update_id!r} in progress (a newer one replaced it, or it was committed)")
        return staged

    def _add(self, update_id: str, staged: _Staged, tensors: dict[str, torch.Tensor]) -> int:
        with self._cv:
            if self._staged.get(update_id) is not staged:
                raise UnknownUpdate(f"no weight update {update_id!r} in progress (a newer one replaced it, or it was committed)")
            staged.tensors.update(tensors)
            return len(staged.tensors)

    def commit(self, update_id: str, expected: str | None = None) -> int:
        """Make a staged update live; returns its version. `expected`: the fingerprint its weights
        must have in the engine's dtype, checked first (a delta update's must be given)."""
        engine = self._need_engine()
        with self._cv:
            staged = self._staged.get(update_id)
            if staged is None:
                raise UnknownUpdate(f"no weight update {update_id!r} in progress")
            if len(staged.tensors) != staged.num_tensors:
                raise ValueError(f"update {update_id} has {len(staged.tensors)} of {staged.num_tensors} tensors; send the rest before commit")
        if staged.adapter:
            check_pairs(staged.tensors)
        if staged.delta_from is not None and expected is None:
            raise ValueError(f"update {update_id} is a delta update: its commit names the fingerprint of the result")
        if expected is not None:
            spec = engine.weight_spec()
            got = fingerprint((n, t.to(spec[n].dtype)) for n, t in staged.tensors.items())
            if got != expected:
                with self._cv:
                    self._staged.pop(update_id, None)
                raise VersionConflict(f"update {update_id} refused at commit: its weights' fingerprint is {got[:12]}, the trainer's {expected[:12]} "
                                      "(a delta applied to other weights than its base); send a full update")  # fmt: skip
        with self._gate.exclusive():  # waits for the generation in flight
            if not staged.force and staged.version != engine.version + 1:
                raise VersionConflict(f"update to version {staged.version} refused at commit: the server is now at {engine.version}")
            self._delta_base = None  # the live weights change: only a base kept below stays one
            try:
                if staged.adapter:
                    if self._base is None:  # the weights live now are full ones: they become the base
                        self._base = (engine.base_weights(), engine.fingerprint())
                    engine.load_weights(merge(self._base[0], staged.tensors))
                    self._adapter_fingerprint = fingerprint(staged.tensors.items())
                else:
                    engine.load_weights(staged.tensors)
                    self._base = self._adapter_fingerprint = None
                    # Tensors in the engine's dtype are the weights it holds (the transformers engine
                    # adopts them: no copy), so a delta against them is against the live weights.
                    spec = engine.weight_spec()
                    if staged.keep_base and all(t.dtype == spec[n].dtype for n, t in staged.tensors.items()):
                        self._delta_base = (staged.version, staged.tensors)
            except ValueError:
                raise  # refused before any weight changed (names, shapes, values)
            except Exception as exc:  # noqa: BLE001 - the engine holds part of the update: no generation until a whole one loads
                self._broken = (
                    f"the weight update to version {staged.version} failed to load ({type(exc).__name__}: {exc}); the engine holds "
                    "part of it, so it generates nothing until a whole update loads (a trainer's resume pushes one)"
                )
                raise EngineFailure(self._broken) from None
            self._broken = None
            engine.version = staged.version
        with self._cv:
            self._staged.pop(update_id, None)
        self._version_changed()
        return staged.version

    def fingerprint(self) -> dict:
        engine = self._need_engine()
        with self._gate.shared():  # not during a commit
            out = {"version": engine.version, "fingerprint": engine.fingerprint()}
            if self._base is not None:
                out |= {"base_fingerprint": self._base[1], "adapter_fingerprint": self._adapter_fingerprint}
            return out
