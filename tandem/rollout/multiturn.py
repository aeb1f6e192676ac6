"""How prompts become trajectories: one completion each, or several turns with tools and
environments. The producer calls one of these; the loop never knows a trajectory had turns.

A multi-turn trajectory is one token sequence after its prompt, of segments:
  model tokens     the engine's token ids exactly, with their behaviour log-probs (loss mask 1);
  inserted tokens  tool results, observations and the chat template's glue (loss mask 0).
The model's tokens are never decoded and re-encoded for training: its text is decoded only to
find its tool calls. Inserted tokens are what the template writes after the reply of a fixed
conversation when the new messages follow it, so they do not depend on how the template would
render the model's own turns. Whether the template would render the whole conversation as these tokens is checked each
turn; a template that rewrites earlier turns (Qwen3's drops <think> from turns before the last
user message) is counted in the metric multi_turn/template_rewrites, and the trajectory keeps the
tokens the model produced.
"""

import asyncio
import copy
import hashlib
import json
import sys
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Protocol

from tandem.rollout.sampling import mix64
from tandem.rollout.tool_workers import ToolWorkers
from tandem.rollout.tools import TOOL_PARSERS, Tool, ToolCall, ToolRunner
from tandem.rollout.types import Completion, SamplingParams

_PLACEHOLDER = "\x00tandem reply\x00"
_STOP_TEXT_CHARS = 64  # the longest text of a stop token looked for at the end of a turn (ChatML's <|im_end|> has 10)


class TrajectoryError(RuntimeError):
    """The user's code that makes trajectories failed (an environment, a rollout_func, a chat
    template): the message names it and what to do. The run stops, as for a reward function's."""


@dataclass
class Prompt:
    ids: list[int]  # the prompt, rendered with the tools
    messages: list | str  # as in the dataset
    row: dict  # the dataset row's other columns


@dataclass
class Trajectory:
    """What one prompt's rollout produced after the prompt."""

    token_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each model token; 0.0 on inserted ones
    loss_mask: list[int] | None  # 1 on model tokens, 0 on inserted ones; None: every token is the model's
    finish_reason: str
    version: int  # the oldest policy version of its turns
    prompt_ids: list[int] | None = None  # a new prompt (an environment's first observation), else None
    info: dict | None = None  # turns: messages, tool calls, versions, an environment's reward (JSON)
    token_versions: list[list[int]] | None = None  # partial rollouts: the model tokens' versions, [version, count] runs
    earlier: list[dict] | None = None  # an agent's rows before this one (Rollout.earlier)


class Rollouts(Protocol):
    def generate(self, engine, prompts: list[Prompt], params: SamplingParams, seeds: list[int], min_version: int) -> list[Trajectory]:
        """One trajectory per prompt, prompt i from seed seeds[i], every turn with weights of version >= min_version."""
        ...

    def close(self) -> None: ...


class Stepwise(Protocol):
    """Partial rollouts (trainer/partial.py): trajectories advanced one engine call at a time,
    each call adding at most a token budget to the model's turn in progress."""

    def begin(self, prompt: Prompt, seed: int) -> "Live": ...

    def take(self, t: "Live", out: Completion) -> str | None:
        """Append one call's answer; the text of a model turn that ended and may call tools, else None."""
        ...

    def respond(self, ended: list[tuple["Live", str]]) -> None:
        """Run the tools the ended turns call, insert their results: the next turns start after them."""
        ...

    def finish(self, t: "Live") -> Trajectory: ...

    def restore(self, saved: dict, prompt: Prompt) -> "Live":
        """A trajectory from a checkpoint (Live.saved), begun from `prompt`."""
        ...


class SingleTurn:
    """One completion per prompt, as the engine returns it."""

    def __init__(self, max_completion_length: int = 0):
        self.max_length = max_completion_length  # of partial rollouts' calls

    def generate(self, engine, prompts, params, seeds, min_version):
        outs = engine.generate([p.ids for p in prompts], params, seeds, min_version=min_version)
        return [Trajectory(o.token_ids, o.logprobs, None, o.finish_reason, o.version) for o in outs]

    def begin(self, prompt: Prompt, seed: int) -> "Live":
        return Live(prompt.ids, [], seed)

    def take(self, t: "Live", out: Completion) -> None:
        if take_chunk(t, out, self.max_length) and t.finish is None:
            t.finish = "stop"

    def respond(self, ended: list) -> None:
        pass

    def finish(self, t: "Live") -> Trajectory:
        return Trajectory(t.ids, t.logprobs, None, t.finish, min((v for v, _ in t.runs), default=t.turn_version), token_versions=t.runs)

    def restore(self, saved: dict, prompt: Prompt) -> "Live":
        return Live.restore(saved, {})

    def close(self) -> None:
        pass


def turn_seed(seed: int, turn: int) -> int:
    """Turn 0 is sampled from the completion's own seed, so a trajectory that calls no tool is
    the completion a single-turn run would get."""
    return seed if turn == 0 else mix64(seed ^ turn)


class TemplateGlue:
    """The tokens to insert after a model turn for new messages, from the chat template."""

    def __init__(self, tokenizer, template_kwargs: dict, where: str):
        self.tokenizer, self.kwargs, self.where = tokenizer, template_kwargs, where
        self.base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PLACEHOLDER}]
        self.rewrites_warned = False
        self.special = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())  # texts of whole template tokens

    def render(self, messages: list, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **self.kwargs)

    def inserted(self, turn_text: str, new_messages: list) -> list[int]:
        """Token ids that follow a model turn whose text (special tokens kept) is `turn_text`:
        what the template writes after an assistant turn's text and for the new messages, with the
        start of it the model already wrote (its stop token: ChatML's <|im_end|>) left out. Only
        what follows the reply counts, so a template that renders earlier turns otherwise once
        more messages follow (Qwen3's <think> blocks) still gives the right tokens."""
        full = self.render(self.base + new_messages, True)
        if full.count(_PLACEHOLDER) != 1:
            raise TrajectoryError(f"the chat template of {self.where} does not write an assistant message's content as it is; "
                                  "multi-turn rollouts need a template that does")  # fmt: skip
        after = full[full.index(_PLACEHOLDER) + len(_PLACEHOLDER) :]
        for k in range(min(len(after), len(turn_text), _STOP_TEXT_CHARS), 0, -1):
            # only what the model wrote as whole tokens of the template's (its stop token): a
            # turn cut after a `<` keeps the <|im_end|> the template writes
            if turn_text.endswith(after[:k]) and (not after[:k].strip() or after[:k].strip() in self.special):
                after = after[k:]
                break
        return self.tokenizer(after, add_special_tokens=False)["input_ids"]

    def rewrites(self, ids: list[int], messages: list) -> bool:
        """Whether the template renders `messages` as something else than the tokens `ids`."""
        same = self.render(messages, True) == self.tokenizer.decode(ids, skip_special_tokens=False)
        if not same and not self.rewrites_warned:
            self.rewrites_warned = True
            print(f"tandem: warning: the chat template of {self.where} renders earlier turns of a conversation differently "
                  "from the tokens the model produced (for example it drops <think> from earlier turns); the trajectories "
                  "keep the model's own tokens (metric multi_turn/template_rewrites)", file=sys.stderr, flush=True)  # fmt: skip
        return not same


def encode_conversation(tokenizer, glue: TemplateGlue, messages: list) -> tuple[list[int], list[int]]:
    """A whole conversation laid out as a trajectory holds it: (token ids, labels), the labels the
    assistant turns' tokens (their stop token included) and -100 elsewhere. For supervised
    warm-ups of the format multi-turn rollouts use."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = tokenizer(glue.render(messages[:first], True), add_special_tokens=False)["input_ids"]
    labels, reply, i = [-100] * len(ids), [], first
    while i < len(messages):
        if messages[i]["role"] == "assistant":
            reply = tokenizer(messages[i]["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids, labels, i = ids + reply, labels + reply, i + 1
            continue
        j = next((k for k in range(i, len(messages)) if messages[k]["role"] == "assistant"), len(messages))
        inserted = glue.inserted(tokenizer.decode(reply, skip_special_tokens=False), messages[i:j])
        ids, labels, i = ids + inserted, labels + [-100] * len(inserted), j
    return ids, labels


@dataclass
class Live:
    """One trajectory while its turns are generated."""

    prompt_ids: list[int]
    messages: list  # the conversation so far, prompt included, as the template renders it
    seed: int
    tools: dict[str, Tool] = field(default_factory=dict)
    env: object = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish: str | None = None  # set when it ends
    versions: list[int] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)  # {"name", "ok", "seconds"} of every tool call
    shown: list = field(default_factory=list)  # the messages after the prompt, as reward functions get them
    rewrites: int = 0
    new_prompt: bool = False
    # Partial rollouts: where the model's turn in progress began in ids and the version of its
    # first token, the engine calls so far, and the model's tokens' versions as [version, count] runs.
    turn_start: int = 0
    turn_version: int = 0
    chunks: int = 0
    runs: list = field(default_factory=list)
    # What its environment was asked, in order ({"step": text} or {"tool": name, "arguments": ...})
    # with a digest of each answer: a checkpoint cannot hold the environment, so a resumed run
    # makes it again by asking the same (MultiTurn.restore).
    env_log: list = field(default_factory=list)

    def saved(self) -> dict:
        """What a checkpoint keeps of it (JSON): everything but its tools, which are the run's."""
        return copy.deepcopy({f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("tools", "env")})

    @classmethod
    def restore(cls, saved: dict, tools: dict) -> "Live":
        return cls(**saved, tools=tools)


def take_chunk(t: Live, out: Completion, max_length: int) -> bool:
    """Partial rollouts: append one engine call's tokens to the model's turn in progress, none
    past max_length; whether the turn ended (its stop token, an error, max_length: then finish
    says which but a stop)."""
    room = max_length - len(t.ids)
    n = min(len(out.token_ids), room)
    if len(t.ids) == t.turn_start:
        t.turn_version = out.version
    t.ids += out.token_ids[:n]
    t.logprobs += out.logprobs[:n]
    t.mask += [1] * n
    if t.runs and t.runs[-1][0] == out.version:
        t.runs[-1][1] += n
    elif n:
        t.runs.append([out.version, n])
    t.chunks += 1
    if out.finish_reason == "error":
        t.finish = "error"
    elif out.finish_reason == "stop" and len(out.token_ids) <= room:
        return True
    elif len(t.ids) >= max_length:
        t.finish = "length"
    return t.finish is not None


class MultiTurn:
    """Turns of model text and tool results (or environment observations) until the model calls
    no tool, max_tool_calling_iterations is reached or max_completion_length is filled.

    A round's trajectories advance together: each turn, every live one's next generation goes to
    the engine in one call, and the tool calls (or environment steps) of all of them run
    concurrently.
    """

    def __init__(
        self,
        tokenizer,
        template_kwargs: dict,
        where: str,
        tools: list[Tool],
        environment_factory: Callable | None,
        environment_tools: list[Tool],
        parser: str,
        max_iterations: int,
        max_completion_length: int,
        tool_timeout: float,
        max_tool_response_tokens: int | None,
        all_done: Callable[[bool], bool] | None = None,
        tool_workers: int = 0,
    ):
        """`all_done` (a sharded colocated engine, whose every generate call is a collective): given
        whether this process's trajectories are all finished, whether every process's are. Turns
        go on until they are, with nothing of this process's own to generate once its are: the
        engine then takes part in the others' decoding (TransformersEngine.generate).
        `tool_workers`: processes that run the plain tools of `tools` (0: threads of this process)."""
        self.all_done = all_done
        self.tokenizer = tokenizer
        self.glue = TemplateGlue(tokenizer, template_kwargs, where)
        self.tools = {t.name: t for t in tools}
        self.environment_factory = environment_factory
        self.env_tools = environment_tools  # its methods as tools, schemas made once from one instance
        self.parse = TOOL_PARSERS[parser]
        self.max_iterations, self.max_length = max_iterations, max_completion_length
        self.max_response = max_tool_response_tokens
        # The longest text one token stands for: a result cut to `tokens * longest` characters
        # still holds its first `tokens` tokens, and a huge one is never tokenized whole.
        self.longest_token = max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))) + 8
        self.runner = ToolRunner(tool_timeout, processes=ToolWorkers(tool_workers) if tool_workers else None)

    def generate(self, engine, prompts, params, seeds, min_version):
        trajs = [self._start(p, s) for p, s in zip(prompts, seeds)]
        for turn in range(self.max_iterations + 1):
            live = [t for t in trajs if t.finish is None]
            if self._all_finished(live):
                break
            # In lockstep every process decodes up to the same max_tokens, so all stop at the same step.
            budget = self.max_length if self.all_done is not None else max(self.max_length - len(t.ids) for t in live)
            outs = engine.generate([t.prompt_ids + t.ids for t in live], replace(params, max_tokens=budget),
                                   [turn_seed(t.seed, turn) for t in live], min_version=min_version)  # fmt: skip
            texts = [self._model_turn(t, o) for t, o in zip(live, outs)]
            asking = [(t, text) for t, text in zip(live, texts) if t.finish is None]
            self._respond(asking, last=turn == self.max_iterations)
        return [self._finish(t) for t in trajs]

    # ---- partial rollouts (Stepwise): a turn may span engine calls, and versions

    def begin(self, prompt: Prompt, seed: int) -> Live:
        return self._start(prompt, seed)

    def take(self, t: Live, out: Completion) -> str | None:
        if not take_chunk(t, out, self.max_length):
            return None
        text = self._turn_message(t, t.ids[t.turn_start :], t.turn_version)
        if t.finish is None and len(t.ids) >= self.max_length:  # ended on its stop token exactly at max_completion_length
            t.finish = "stop"
        return None if t.finish else text

    def respond(self, ended: list[tuple[Live, str]]) -> None:
        last = [len(t.versions) > self.max_iterations for t, _ in ended]  # its last turn: no tool runs after it
        self._respond([e for e, x in zip(ended, last) if not x], last=False)
        self._respond([e for e, x in zip(ended, last) if x], last=True)
        for t, _ in ended:
            t.turn_start = len(t.ids)

    def finish(self, t: Live) -> Trajectory:
        return replace(self._finish(t), token_versions=t.runs)

    def restore(self, saved: dict, prompt: Prompt) -> Live:
        """With an environment, a new one from environment_factory, reset with the prompt's row
        and asked again what the trajectory's asked before the checkpoint; each answer must be
        the one it gave then (its digest), or the resumed run would go on from another state."""
        t = Live.restore(saved, self.tools)
        if self.environment_factory is None:
            return t
        fresh = self._start(prompt, t.seed)
        t.env, t.tools = fresh.env, fresh.tools
        log = t.env_log
        differs = "reset" if fresh.prompt_ids != t.prompt_ids else next(  # reset's observation is in the prompt
            (f"its call {k + 1} of {len(log)} ({e.get('tool', 'step')})" for k, e in enumerate(log) if _digest(self._ask(t, e)) != e["answer"]), None)
        if differs is not None:
            raise TrajectoryError(f"environment_factory: a trajectory in flight at the checkpoint is restored by asking a new environment "
                                  f"what its own was asked, and {differs} answered otherwise than before the checkpoint. A resumed run "
                                  "with max_tokens_per_round needs an environment whose answers follow from reset's row and its calls "
                                  "(seed its randomness from them)")  # fmt: skip
        return t

    def _all_finished(self, live: list) -> bool:
        """Whether the round's turns are over: nothing live here, and with `all_done` on any process."""
        return self.all_done(not live) if self.all_done is not None else not live

    def _start(self, prompt: Prompt, seed: int) -> Live:
        messages = copy.deepcopy(prompt.messages)
        t = Live(prompt.ids, messages, seed, self.tools)
        if self.environment_factory is not None:
            t.env = self._bounded("its constructor", self.environment_factory)
            t.tools = {**self.tools, **{tool.name: replace(tool, fn=getattr(t.env, tool.name)) for tool in self.env_tools}}
            observation = self._bounded("reset", t.env.reset, **prompt.row) if hasattr(t.env, "reset") else None
            if observation is not None:  # appended to the prompt's last message, as TRL does
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + str(observation)}
                t.prompt_ids = self.tokenizer(self.glue.render(messages, True), add_special_tokens=False)["input_ids"]
                t.new_prompt = True
        return t

    def _model_turn(self, t: Live, out: Completion) -> str:
        """Append the engine's tokens; returns their text (for parsing only)."""
        room = self.max_length - len(t.ids)
        ids, logprobs = out.token_ids[:room], out.logprobs[:room]
        t.ids += ids
        t.logprobs += logprobs
        t.mask += [1] * len(ids)
        text = self._turn_message(t, ids, out.version)
        # Truncated only where the last token is not a stop token (TRL's rule, as in one turn): a
        # turn that ends on its stop token exactly at max_completion_length is a finished answer.
        if out.finish_reason == "error":
            t.finish = "error"
        elif len(out.token_ids) > room or out.finish_reason == "length":
            t.finish = "length"
        elif len(t.ids) >= self.max_length:
            t.finish = "stop"
        return text

    def _turn_message(self, t: Live, ids: list[int], version: int) -> str:
        """The model's turn of tokens `ids` as a message of the conversation; its text (for parsing only)."""
        t.versions.append(version)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        message = {"role": "assistant", "content": text}
        t.messages.append(message)
        t.shown.append(dict(message))
        return text

    def _respond(self, asking: list[tuple[Live, str]], last: bool) -> None:
        """Run the tools the turns call (or the environments' step), then insert the results."""
        calls, owners, stepping = [], [], []
        for t, text in asking:
            found = self.parse(text) if t.tools else []
            if found:
                t.shown[-1]["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in found]
            if last or (not found and not hasattr(t.env, "step")):
                t.finish = "stop"
            elif found:
                calls += [(t.tools, c) for c in found]
                owners += [t] * len(found)
            else:
                stepping.append((t, text))
        # Each trajectory has its own environment, so their steps run at once in the tools' pool
        # (a step that waits on a game server or a judge need not wait for the others').
        steps = [self.runner.pool.submit(_environment_call, t.env.step, "step", text) for t, text in stepping]
        for (t, text), step in zip(stepping, steps):
            observation = self._observation(step)
            t.env_log.append({"step": text, "answer": _digest(observation)})
            if observation is None:
                t.finish = "stop"
            else:
                self._insert(t, [{"role": "user", "content": str(observation)}])
        results = self.runner.run(calls)
        new: dict[int, tuple[Live, list]] = {}
        env_methods = {tool.name for tool in self.env_tools}
        for t, call, result in zip(owners, calls, results):
            t.calls.append({"name": result.name, "ok": result.ok, "seconds": result.seconds})
            if t.env is not None and call[1].name in env_methods:
                t.env_log.append({"tool": call[1].name, "arguments": call[1].arguments, "answer": _digest(result.content)})
            content = self._cap(result.content, self.max_length - len(t.ids))
            new.setdefault(id(t), (t, []))[1].append({"role": "tool", "name": call[1].name, "content": content})
        for t, messages in new.values():
            self._insert(t, messages)

    def _ask(self, t: Live, entry: dict):
        """Ask t's environment again what env_log's `entry` asked; its answer."""
        if "step" in entry:
            return self._bounded("step", t.env.step, entry["step"])
        return self.runner.run([(t.tools, ToolCall(entry["tool"], entry["arguments"]))])[0].content

    def _bounded(self, what: str, fn: Callable, *args, **kwargs):
        """An environment's own call (its constructor, reset, step) in the tools' pool, within
        tool_timeout, as tool calls are: one that sleeps held the round until SIGTERM's bound."""
        return self._observation(self.runner.pool.submit(_environment_call, fn, what, *args, **kwargs), what)

    def _observation(self, call, what: str = "step"):
        """What an environment's call (a future in the tools' pool) returned, within tool_timeout."""
        try:
            return call.result(timeout=self.runner.timeout)
        except FutureTimeout:
            raise TrajectoryError(f"environment_factory: {what} took longer than tool_timeout ({self.runner.timeout:g}s)") from None

    def _cap(self, content: str, room: int) -> str:
        """A tool's result as the model sees it (and completions.jsonl shows it): at most
        max_tool_response_tokens tokens, and never more text than the `room` tokens left in the
        trajectory can hold. Cut by characters first, then by tokens: a result of 100 MB took 12
        GB to tokenize whole."""
        limit = room if self.max_response is None else min(room, self.max_response)
        text = content[: max(0, limit) * self.longest_token]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= limit and len(text) == len(content):
            return content
        if self.max_response is not None and len(ids) > self.max_response:
            return self.tokenizer.decode(ids[: self.max_response]) + " [cut at max_tool_response_tokens]"
        return self.tokenizer.decode(ids[:limit]) + " [cut at max_completion_length]"

    def _insert(self, t: Live, messages: list) -> None:
        turn_text = self.tokenizer.decode(t.ids[len(t.ids) - _last_turn_length(t) :], skip_special_tokens=False)
        ids = self.glue.inserted(turn_text, messages)
        t.messages += messages
        t.shown += messages
        t.rewrites += self.glue.rewrites(t.prompt_ids + t.ids + ids, t.messages)
        room = self.max_length - len(t.ids)
        t.ids += ids[:room]
        t.logprobs += [0.0] * len(ids[:room])
        t.mask += [0] * len(ids[:room])
        if len(ids) >= room:  # nothing left for the model's next turn
            t.finish = "length"

    def _finish(self, t: Live) -> Trajectory:
        info = {
            "turns": len(t.versions),
            "messages": t.shown,
            "tool_calls": t.calls,
            "versions": t.versions,
            "template_rewrites": t.rewrites,
            "environment_reward": _reward_number(_environment_call(t.env.get_reward, "get_reward")) if hasattr(t.env, "get_reward") else None,
        }
        return Trajectory(t.ids, t.logprobs, t.mask, t.finish or "stop", min(t.versions), t.prompt_ids if t.new_prompt else None, info)

    def close(self) -> None:
        self.runner.close()


def _environment_call(fn: Callable, what: str, *args, **kwargs):
    """An environment's own code: a failure there stops the round naming it (a tool's failure,
    by contrast, is the model's to see)."""
    try:
        return fn(*args, **kwargs)
    except SystemExit as exc:  # the environment's, not the run's: ending the run with its code would hide it
        raise TrajectoryError(f"environment_factory: {what} called sys.exit({exc.code!r})") from None
    except Exception as exc:
        raise TrajectoryError(f"environment_factory: {what} raised {type(exc).__name__}: {exc}") from exc


def _digest(answer) -> str:
    """An environment's answer as the model is shown it (its text), as Live.env_log keeps it."""
    return hashlib.sha256(("\x00none" if answer is None else str(answer)).encode()).hexdigest()[:16]


def _reward_number(value) -> float | None:
    """get_reward()'s value as a float, as TRL takes it (numpy's float32 included), or None."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        raise TrajectoryError(f"environment_factory: get_reward returned {value!r}; return a number, or None for no opinion") from None


def _last_turn_length(t: Live) -> int:
    """Tokens of the model's last turn: the run of mask 1 at the end."""
    n = 0
    for m in reversed(t.mask):
        if not m:
            break
        n += 1
    return n


class CoroutineRollouts:
    """Rollouts made by a user's coroutine, one per prompt (rollout_func, agent_func): `_one`
    makes a trajectory, and the engine calls of a round's trajectories batch through _Batcher."""

    def __init__(self):
        self._loops = threading.local()

    def generate(self, engine, prompts, params, seeds, min_version):
        # One event loop per calling thread (the producer's, and the evaluator's), kept across
        # rounds: what the user's code keeps between calls (an HTTP client, a semaphore) stays
        # bound to the loop it runs on. In the calling thread, so that a colocated engine generates
        # under that thread's autocast, as the training forward computes.
        return self.loop().run_until_complete(self._all(_Batcher(engine, params, min_version, len(prompts)), prompts, seeds))

    def loop(self) -> asyncio.AbstractEventLoop:
        """The calling thread's event loop."""
        if getattr(self._loops, "loop", None) is None:
            self._loops.loop = asyncio.new_event_loop()
        return self._loops.loop

    async def _all(self, batcher: "_Batcher", prompts, seeds):
        return list(await asyncio.gather(*(self._one(batcher, p, s) for p, s in zip(prompts, seeds))))

    async def _one(self, batcher: "_Batcher", prompt: Prompt, seed: int) -> Trajectory:
        raise NotImplementedError

    def close(self) -> None:
        pass


class RolloutFunction(CoroutineRollouts):
    """A user's own agent, `rollout_func: file.py:fn`: `async def fn(prompt, generate, tokenizer) -> dict`.

    `prompt` is {"prompt": the dataset's prompt, "prompt_ids": its tokens, **the row's other
    columns}; `tokenizer` the run's; `await generate(token_ids, max_tokens=None)` returns the engine's completion of
    those tokens as {"token_ids", "logprobs", "version", "finish_reason"}. The function returns
    {"completion_ids": every token after the prompt, "loss_mask": 1 on the model's tokens},
    optionally with "messages" (what reward functions get as the completion).

    Each run of the model's tokens (loss mask 1) must be the whole answer of one generate call
    made on exactly the tokens before it: prompt_ids and completion_ids up to there. A trajectory
    whose trained tokens the engine did not produce, or produced after other tokens (a
    conversation rendered anew for the next call), is refused, naming the function: its
    behaviour log-probs would belong to another context. Calls whose answers it does not return
    (best-of-n's other drafts) are not trained. Log-probs and versions come from the calls, never
    from the function. Each call draws from its own seed, by the order the calls are made in; the
    generate calls of all of a round's trajectories that are waiting go to the engine as one batch.
    """

    def __init__(self, fn: Callable, name: str, tokenizer, max_completion_length: int):
        super().__init__()
        self.fn, self.name, self.tokenizer, self.max_length = fn, name, tokenizer, max_completion_length

    async def _one(self, batcher: "_Batcher", prompt: Prompt, seed: int) -> Trajectory:
        calls: list[tuple[list[int], Completion | None]] = []  # (the tokens asked on, the answer), in the order made

        async def generate(token_ids: list[int], max_tokens: int | None = None) -> dict:
            index, ids = len(calls), list(token_ids)
            calls.append((ids, None))
            # the seed by the call's index when it is made: concurrent calls (asyncio.gather) draw apart
            out = await batcher.request(ids, max_tokens, turn_seed(seed, index))
            calls[index] = (ids, out)
            return {"token_ids": list(out.token_ids), "logprobs": list(out.logprobs), "version": out.version, "finish_reason": out.finish_reason}

        try:
            result = await self.fn({"prompt": prompt.messages, "prompt_ids": list(prompt.ids), **prompt.row}, generate, self.tokenizer)
        except SystemExit as exc:  # the function's, not the run's: ending the run with its code would hide it
            raise TrajectoryError(f"rollout_func {self.name} called sys.exit({exc.code!r}); it must return its trajectory") from None
        except Exception as exc:
            raise TrajectoryError(f"rollout_func {self.name} raised {type(exc).__name__}: {exc}") from exc
        finally:
            batcher.finished()
        return self._trajectory(result, list(prompt.ids), [(ids, out) for ids, out in calls if out is not None])

    def _trajectory(self, result, prompt_ids: list[int], calls: list[tuple[list[int], Completion]]) -> Trajectory:
        if not isinstance(result, dict) or not {"completion_ids", "loss_mask"} <= result.keys():
            raise TrajectoryError(f"rollout_func {self.name} returned {type(result).__name__}; return a dict with completion_ids and loss_mask")
        ids, mask = list(result["completion_ids"]), [int(m) for m in result["loss_mask"]]
        if len(ids) != len(mask) or set(mask) - {0, 1}:
            raise TrajectoryError(f"rollout_func {self.name}: loss_mask must be 0 or 1 for each of the {len(ids)} completion_ids, got {len(mask)} values")
        used = self._answers(prompt_ids, ids, mask, calls)
        if not used:
            raise TrajectoryError(f"rollout_func {self.name} returned no model tokens (loss_mask 1); return the answer of at least one generate call")
        logprobs = iter(lp for o in used for lp in o.logprobs)
        finish = "error" if any(o.finish_reason == "error" for o in used) else used[-1].finish_reason
        if len(ids) > self.max_length:
            ids, mask, finish = ids[: self.max_length], mask[: self.max_length], "length"
        elif len(ids) == self.max_length and not (mask[-1] and finish == "stop"):
            finish = "length"  # filled, and its last token is not a stop token (TRL's rule)
        messages = result.get("messages") or []
        try:
            json.dumps(messages)
        except (TypeError, ValueError) as exc:  # they are logged, and saved with the rounds generated ahead
            raise TrajectoryError(f"rollout_func {self.name}: its messages are not JSON ({exc}); return plain dicts, lists, text and numbers") from None
        info = {"turns": len(used), "messages": messages, "tool_calls": [], "versions": [o.version for o in used],
                "template_rewrites": 0, "environment_reward": None}  # fmt: skip
        return Trajectory(ids, [next(logprobs) if m else 0.0 for m in mask], mask, finish, min(o.version for o in used), None, info)

    def _answers(self, prompt_ids: list[int], ids: list[int], mask: list[int], calls: list[tuple[list[int], Completion]]) -> list[Completion]:
        """The calls whose answers the trajectory trains, in its order: each run of model tokens
        (mask 1) is the whole answer of a call made on prompt_ids + ids up to where it starts."""
        free, used, pos = [c for c in calls if c[1].token_ids], [], 0
        while pos < len(ids):
            if not mask[pos]:
                pos += 1
                continue
            answers = [c for c in free if ids[pos : pos + len(c[1].token_ids)] == c[1].token_ids and all(mask[pos : pos + len(c[1].token_ids)])]
            match = next((c for c in answers if c[0] == prompt_ids + ids[:pos]), None)
            if match is None and answers:
                raise TrajectoryError(
                    f"rollout_func {self.name}: the model tokens at completion_ids[{pos}:] were generated after other tokens than "
                    f"prompt_ids + completion_ids[:{pos}], so their log-probs belong to another context (a conversation rendered anew?); "
                    "ask each generate call on prompt_ids + the completion_ids so far"
                )
            if match is None:
                raise TrajectoryError(
                    f"rollout_func {self.name}: the model tokens (loss_mask 1) at completion_ids[{pos}:] are not the whole answer of any "
                    "of its generate calls; never train on tokens the engine did not produce"
                )
            free.remove(match)
            used.append(match[1])
            pos += len(match[1].token_ids)
        return used


class _Batcher:
    """Gathers the generate calls of a round's trajectories: once every trajectory still running
    waits on one, they go to the engine as one call. Calls also go once none has come for
    STALL_SECONDS: a trajectory may wait on something else than generate (a lock another one
    holds across its own call, a slow tool), and waiting for it would never end. Which calls
    share a batch changes no completion (each has its own seed; engines are batch-invariant)."""

    STALL_SECONDS = 0.05

    def __init__(self, engine, params: SamplingParams, min_version: int, running: int):
        self.engine, self.params, self.min_version, self.running = engine, params, min_version, running
        self.waiting: list[tuple[list[int], int | None, int, str | None, asyncio.Future]] = []
        self.requests = 0  # made so far: a stall is no new one since a check was set
        self.generating = False  # in the engine's call (which holds the event loop: a watchdog's to know)

    async def request(self, ids: list[int], max_tokens: int | None, seed: int, grammar: str | None = None) -> Completion:
        """`grammar`: what the answer must be (rollout.grammar); requests of one grammar share a call."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.waiting.append((ids, max_tokens, seed, grammar, future))
        self.requests += 1
        self._maybe_flush()
        if not future.done():
            loop.call_later(self.STALL_SECONDS, self._flush_if_stalled, self.requests)
        return await future

    def finished(self) -> None:
        self.running -= 1
        self._maybe_flush()

    def _flush_if_stalled(self, requests: int) -> None:
        if requests == self.requests:
            self._maybe_flush(stalled=True)

    def _maybe_flush(self, stalled: bool = False) -> None:
        # A request the function stopped waiting for (asyncio.wait_for past its time) is dropped:
        # its trajectory no longer waits on it, and its future takes no result.
        self.waiting = [w for w in self.waiting if not w[-1].done()]
        if not self.waiting or (len(self.waiting) < self.running and not stalled):
            return
        batch, self.waiting = self.waiting, []
        for grammar in dict.fromkeys(w[3] for w in batch):  # one engine call per grammar, in the order they came
            self._call([w for w in batch if w[3] == grammar], grammar)

    def _call(self, batch: list, grammar: str | None) -> None:
        budget = max(m or self.params.max_tokens for _, m, *_ in batch)
        self.generating = True
        try:
            params = replace(self.params, max_tokens=budget, grammar=grammar)
            outs = self.engine.generate([b[0] for b in batch], params, [b[2] for b in batch], min_version=self.min_version)
        except Exception as exc:  # every waiting trajectory fails with the engine's error
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        finally:
            self.generating = False
        for (_, max_tokens, _, _, future), out in zip(batch, outs):
            if future.done():  # given up while the engine generated
                continue
            limit = max_tokens or self.params.max_tokens
            cut = len(out.token_ids) > limit
            future.set_result(replace(out, token_ids=out.token_ids[:limit], logprobs=out.logprobs[:limit], finish_reason="length" if cut else out.finish_reason))
