"""Agents as users write them, trained through the OpenAI-compatible endpoint (`agent_func`).

`agent_func: file.py:fn` is an `async def fn(row, client)`: `row` is the dataset row ("prompt"
and the other columns), `client` an `openai.AsyncOpenAI` bound to a session of its own
(`client.base_url` and `client.api_key` for an agent that builds its own client). The function
runs the agent, unchanged, against that client, and may return a reward (a number, given to
reward functions as `environment_reward`, as an environment's get_reward) or nothing.

Each trajectory is one session (server/sessions.py): what the agent asks is kept as the
engine's token ids, turn by turn, with behaviour log-probs and versions. The trajectory trained
is the session's last row: its conversation at the end, which the reward judged. An agent that
rewrote its history has earlier rows; they are counted (agents/new_rows) and not trained (one
record per trajectory keeps every round the same size).

Bounds: agent_timeout for the whole episode, max_turns requests and max_completion_length
tokens per row. An agent that raises or overruns agent_timeout is ended and counted
(agents/errors, agents/timeouts); its trajectory is dropped (no reward, no loss: as an engine's
error) or scored 0 with what it generated (agent_failure). A request refused by a bound ends the
episode without an error: an agent that raises on it trains on its conversation so far. A failing
engine fails the round, as in every other mode: an agent never hides it.

The requests of a round's sessions batch into the engine as rollout_func's do (multiturn._Batcher):
once every running agent waits on one, or none has come for 50 ms. Turn k of a trajectory draws
from seed turn_seed(its seed, k), so a deterministic agent reproduces its tokens from the run's seed.
"""

import asyncio
import inspect
import threading
from dataclasses import dataclass

from tandem.rollout.multiturn import CoroutineRollouts, Prompt, Trajectory, TrajectoryError, _Batcher, _reward_number
from tandem.rollout.types import Completion
from tandem.server.gateway import Gateway
from tandem.server.sessions import Row, SessionServing, SessionStore


@dataclass(frozen=True)
class AgentOptions:
    timeout: float  # agent_timeout: seconds for one episode
    max_turns: int
    max_completion_length: int
    failure: str  # agent_failure: 'drop' or 'zero'


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

    def generate(self, engine, prompts, params, seeds, min_version):
        with self._lock:  # the producer's thread and the evaluator's
            if self.gateway is None:
                self.gateway = Gateway(self.serving)
        return super().generate(engine, prompts, params, seeds, min_version)

    async def _one(self, batcher: _Batcher, prompt: Prompt, seed: int) -> Trajectory:
        loop = asyncio.get_running_loop()

        async def submit(ids: list[int], max_tokens: int, turn_seed: int) -> Completion:
            # From the gateway's thread into this loop, where the batcher and the engine run.
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(batcher.request(ids, max_tokens, turn_seed), loop))

        o = self.options
        session = self.store.open(seed, submit, o.max_turns, o.max_completion_length)
        client = self._openai.AsyncOpenAI(base_url=self.gateway.base_url(session.id), api_key=self.gateway.api_key, max_retries=0, timeout=o.timeout)
        result, error, timed_out = None, None, False
        try:
            result = await asyncio.wait_for(self.fn({"prompt": prompt.messages, **prompt.row}, client), o.timeout)
        except TimeoutError:
            timed_out = True
        except (Exception, SystemExit) as exc:  # the agent's, not the run's: counted, and the run goes on
            error = f"{type(exc).__name__}: {exc}"
        finally:
            batcher.finished()
            rows = self.store.close(session.id)
            await client.close()
        if session.engine_error is not None:
            raise session.engine_error
        failed = timed_out or (error is not None and not session.limited)
        reward = None
        if not failed and result is not None:
            try:
                reward = _reward_number(result)
            except TrajectoryError:
                failed, error = True, f"it returned {result!r}; return a number (its reward) or None"
        return self._trajectory(rows, session.turns, failed, error, timed_out, reward, batcher.min_version)

    def _trajectory(self, rows: list[Row], requests: int, failed: bool, error: str | None, timed_out: bool, reward: float | None, min_version: int) -> Trajectory:
        turns = [r for r in rows if r.versions]  # rows with at least one answer (a refused first request leaves none)
        # requests: the session's turns, every row's (the trained row's are the last of them)
        agent = {"error": failed and not timed_out, "timeout": timed_out, "new_rows": max(0, len(turns) - 1), "requests": requests, "why": error}
        if not turns:  # nothing to train: the prompt and one eos token, out of the loss
            info = {"turns": 0, "messages": [], "tool_calls": [], "versions": [min_version], "template_rewrites": 0, "environment_reward": None, "agent": agent}
            return Trajectory([self.tokenizer.eos_token_id], [0.0], [0], "error", min_version, None, info)
        row = turns[-1]
        finish = "error" if failed and self.options.failure == "drop" else row.finish
        info = {"turns": len(row.versions), "messages": row.messages[row.prompt_length :] if row.chat else [], "tool_calls": [], "versions": row.versions,
                "template_rewrites": row.rewrites, "environment_reward": reward, "agent": agent,
                "zero_reward": failed and self.options.failure == "zero"}  # fmt: skip
        return Trajectory(row.ids, row.logprobs, row.mask, finish, min(row.versions), row.prompt_ids, info)

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.close()
