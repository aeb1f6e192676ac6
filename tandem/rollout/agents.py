"""Agents as users write them, trained through the OpenAI-compatible endpoint (`agent_func`).

`agent_func: file.py:fn` is an `async def fn(row, client)`: `row` is the dataset row ("prompt"
and the other columns), `client` an `openai.AsyncOpenAI` bound to a session of its own
(`client.base_url` and `client.api_key` for an agent that builds its own client). The function
runs the agent, unchanged, against that client, and may return a reward (a number, given to
reward functions as `environment_reward`, as an environment's get_reward) or nothing.

Each trajectory is one session (server/sessions.py): what the agent asks is kept as the
engine's token ids, turn by turn, with behaviour log-probs and versions. The trajectory trained
is every row of the session: the last, its conversation at the end, which the reward judged, and
the rows an agent started by rewriting its history (agents/new_rows), which ride on it
(Rollout.earlier) with its reward and advantage and train in its micro-batch as one sequence of
the loss, so that a round keeps its size and N processes still train as 1. agent_train_rows:
last trains the last row only (agents/rows_per_trajectory says which).

Bounds: agent_timeout for the whole episode; max_turns requests, max_prompt_length and
max_completion_length tokens per row and the model's context (sessions.Bounds). An agent that
raises, exits, or overruns agent_timeout is ended and counted (agents/errors, agents/timeouts),
never the run's failure (with agent_workers it runs in a worker process, where os._exit and a
blocked event loop take only the worker with them); its trajectory is dropped (no reward, no
loss: as an engine's error) or scored 0 with what it generated (agent_failure). Most agents
failing, step after step, stop the run (metrics.AgentFailures). A request refused by a bound ends the
episode without an error: an agent that raises on it trains on its conversation so far. A failing
engine fails the round, as in every other mode: an agent never hides it.

The requests of a round's sessions batch into the engine as rollout_func's do (multiturn._Batcher):
once every running agent waits on one, or none has come for 50 ms. Turn k of a trajectory draws
from seed turn_seed(its seed, k), so a deterministic agent reproduces its tokens from the run's seed.
"""

import asyncio
import inspect
import logging
import math
import threading
import time
from dataclasses import dataclass

from tandem.aio import DaemonPool
from tandem.rollout.multiturn import CoroutineRollouts, Prompt, Trajectory, TrajectoryError, _Batcher, _reward_number
from tandem.rollout.tool_workers import Workers, WorkerFailed, serve_agents
from tandem.rollout.types import Completion
from tandem.server.gateway import Gateway
from tandem.server.sessions import Bounds, Row, SessionServing

log = logging.getLogger("tandem")
WORKER_START_SECONDS = 300  # for agent_workers to start (their imports), before the first round's episodes


@dataclass(frozen=True)
class AgentOptions:
    timeout: float  # agent_timeout: seconds for one episode
    bounds: Bounds  # of each session: max_turns, max_completion_length, max_prompt_length, the context
    failure: str  # agent_failure: 'drop' or 'zero'
    workers: int = 0  # agent_workers: processes that run the agents (0: this process's event loop)
    train_rows: str = "all"  # agent_train_rows: 'all' of a session's rows, or its 'last'


class AgentFunction(CoroutineRollouts):
    def __init__(self, fn, name: str, tokenizer, serving: SessionServing, options: AgentOptions):
        try:
            import openai
        except ImportError:
            raise ImportError("agent_func needs the openai package: pip install 'tandem-rl[agents]'") from None
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"agent_func {name} must be an async def fn(row, client)")
        super().__init__()
        self.fn, self.name, self.tokenizer, self.options = fn, name, tokenizer, options
        self.serving, self.store = serving, serving.store
        self.gateway: Gateway | None = None  # started by the first round, so that a run that fails before one leaves no thread
        self._openai = openai
        self._lock = threading.Lock()
        self.workers = Workers(options.workers, serve_agents) if options.workers else None
        self._waiting = DaemonPool(options.workers, "tandem-agent-wait") if options.workers else None  # a thread per worker's call

    def generate(self, engine, prompts, params, seeds, min_version):
        with self._lock:  # the producer's thread and the evaluator's
            if self.gateway is None:
                self.gateway = Gateway(self.serving)
        if self.workers is not None:  # before any episode's clock starts
            try:
                self.workers.start(WORKER_START_SECONDS)
            except WorkerFailed as exc:
                raise TrajectoryError(f"agent_workers: {exc}") from None
        batcher, done = _Batcher(engine, params, min_version, len(prompts)), threading.Event()
        threading.Thread(target=self._watch, args=(self.loop(), batcher, done), name="tandem-agent-watch", daemon=True).start()
        try:
            return self.loop().run_until_complete(self._all(batcher, prompts, seeds))
        finally:
            done.set()

    def _watch(self, loop: asyncio.AbstractEventLoop, batcher: _Batcher, done: threading.Event) -> None:
        """Says, every agent_timeout once it has passed, that an agent holds the round's event
        loop, if one does: an async def that blocks (time.sleep, a threading wait, a busy loop)
        cannot be cancelled, and the round would wait on it with nothing said."""
        start, timeout = time.monotonic(), self.options.timeout
        while not done.wait(timeout + 5):
            answered = threading.Event()
            loop.call_soon_threadsafe(answered.set)
            if not answered.wait(5) and not done.is_set() and not batcher.generating:
                log.warning(f"agent_func {self.name}: an agent has held the round's event loop for {time.monotonic() - start:.0f}s, past "
                            f"agent_timeout={timeout:g}s, and nothing in this process can end it: it blocks in an async def (time.sleep, "
                            "a threading wait, a busy loop). Await instead (asyncio.sleep, asyncio.to_thread).")  # fmt: skip

    async def _one(self, batcher: _Batcher, prompt: Prompt, seed: int) -> Trajectory:
        loop = asyncio.get_running_loop()

        async def submit(ids: list[int], max_tokens: int, turn_seed: int, grammar: str | None) -> Completion:
            # From the gateway's thread into this loop, where the batcher and the engine run.
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(batcher.request(ids, max_tokens, turn_seed, grammar), loop))

        o = self.options
        session = self.store.open(seed, submit, o.bounds)
        result, error, timed_out, client = None, None, False, None
        row, base_url = {"prompt": prompt.messages, **prompt.row}, self.gateway.base_url(session.id)
        if self.workers is None:
            client = self._openai.AsyncOpenAI(base_url=base_url, api_key=self.gateway.api_key, max_retries=0, timeout=o.timeout)
            episode = asyncio.ensure_future(contained(self.fn(row, client)))
        else:  # the worker makes its own client
            episode = asyncio.ensure_future(self._in_worker(row, base_url))
        try:
            # Not wait_for: it waits for the cancelled episode to end, and an agent that catches
            # CancelledError and goes on would hold the round for ever. Past its time the episode
            # is cancelled and left: its session is closed, so its requests get 404.
            done, _ = await asyncio.wait({episode}, timeout=o.timeout)
            if episode in done:
                result, error = episode.result()
            else:
                episode.cancel()
                timed_out = True
        finally:
            batcher.finished()
            rows = self.store.close(session.id)
            if client is not None:
                await client.close()
        if session.engine_error is not None:
            raise session.engine_error
        failed = timed_out or (error is not None and not session.limited)
        reward = None
        if not failed and result is not None:
            try:
                reward = _reward_number(result)
            except TrajectoryError:
                reward = math.nan
            if not math.isfinite(reward):
                failed, error, reward = True, f"it returned {_short(result)}; return a finite number (its reward) or None", None
        return self._trajectory(rows, session.turns, failed, error, timed_out, reward, batcher.min_version)

    async def _in_worker(self, row: dict, base_url: str) -> tuple[object, str | None]:
        """The episode in a worker process: its (result, error). The worker is given a second past
        agent_timeout, so that the episode times out here first (agents/timeouts), then ended."""
        timeout = self.options.timeout
        try:
            return await asyncio.wrap_future(self._waiting.submit(self.workers.call, (self.name, row, base_url, self.gateway.api_key, timeout),
                                                                  timeout + 1, "agent_timeout"))  # fmt: skip
        except WorkerFailed as exc:
            return None, f"WorkerFailed: the agent {exc}"

    def _trajectory(self, rows: list[Row], requests: int, failed: bool, error: str | None, timed_out: bool, reward: float | None, min_version: int) -> Trajectory:
        turns = [r for r in rows if r.versions]  # rows with at least one answer (a refused first request leaves none)
        # requests: the session's turns, every row's (the trained row's are the last of them)
        trained = turns if self.options.train_rows == "all" else turns[-1:]
        agent = {"error": failed and not timed_out, "timeout": timed_out, "new_rows": max(0, len(turns) - 1), "rows": len(trained),
                 "requests": requests, "why": error}  # fmt: skip
        if not turns:  # nothing to train: the prompt and one eos token, out of the loss
            info = {"turns": 0, "messages": [], "tool_calls": [], "versions": [min_version], "template_rewrites": 0, "environment_reward": None, "agent": agent}
            return Trajectory([self.tokenizer.eos_token_id], [0.0], [0], "error", min_version, None, info)
        earlier = [{"prompt_ids": r.prompt_ids, "completion_ids": r.ids, "behav_logprobs": r.logprobs, "loss_mask": r.mask, "version": min(r.versions)}
                   for r in trained[:-1]]  # fmt: skip
        row = turns[-1]
        finish = "error" if failed and self.options.failure == "drop" else row.finish
        info = {"turns": len(row.versions), "messages": row.messages[row.prompt_length :] if row.chat else [], "tool_calls": [], "versions": row.versions,
                "template_rewrites": row.rewrites, "environment_reward": reward, "agent": agent,
                "zero_reward": failed and self.options.failure == "zero"}  # fmt: skip
        version = min(v for r in trained for v in r.versions)
        return Trajectory(row.ids, row.logprobs, row.mask, finish, version, row.prompt_ids, info, earlier=earlier or None)

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.close()
        if self.workers is not None:
            self.workers.close()


async def contained(episode) -> tuple[object, str | None]:
    """The agent's result, or what ended it as text, whatever way it ended: sys.exit,
    KeyboardInterrupt and a CancelledError of its own are its failure, never the run's (raised
    in the task wait_for runs, SystemExit and KeyboardInterrupt would leave the event loop and end
    the run with the agent's exit code). The cancellation at agent_timeout ends the task."""
    try:
        return await episode, None
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise
        return None, "CancelledError: the agent raised it, not cancelled by agent_timeout"
    except SystemExit as exc:
        return None, f"SystemExit: it called sys.exit({exc.code!r}); an agent ends by returning"
    except BaseException as exc:  # noqa: BLE001 - the agent's, not the run's: counted, and the run goes on
        return None, f"{type(exc).__name__}: {exc}"


def _short(value) -> str:
    text = f"an integer of {value.bit_length()} bits" if isinstance(value, int) and value.bit_length() > 64 else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
