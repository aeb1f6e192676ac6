"""Agent sessions: the OpenAI-compatible endpoint inside one trajectory, kept as token ids.

The trainer opens one session per trajectory (rollout/agents.py) and hands the agent a base URL
that names it. Each request of the session is a turn. The first is rendered with the run's chat
template, once. A request whose messages extend the conversation so far (the earlier messages
unchanged, the assistant replies the ones this server gave) continues it: its prompt is the
previous prompt and completion tokens exactly, then the template's glue and the new messages
(multiturn.TemplateGlue, as tool results are inserted). The server's own replies are never
encoded again. A request that does not extend it (the agent dropped, edited or reordered earlier
messages, or changed its tools) starts a new row from its own rendering: a session is a list of
rows, each one token sequence the model's tokens of which are exactly the engine's, with their
behaviour log-probs and the version of each turn. Nothing is ever spliced.

/v1/completions in a session works on token ids the same way: a prompt that starts with the
row's tokens continues it, any other starts a row.

The run decides how a session samples (its temperature, top_p, seeds), so that the behaviour
log-probs are the ones the loss corrects against: a request that asks for other values, n > 1 or
a seed is refused (400, naming the field). Bounds (Bounds): max_turns requests, max_prompt_length
tokens of a row's prompt, max_completion_length tokens after it, and the model's context; past
any a request is refused (400, naming the bound) and the row ends there. Nothing an agent sends
reaches the engine unless it fits: an over-long prompt or a token id outside the vocabulary is
that agent's 400, never the round's failure.
"""

import asyncio
import json
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from tandem.rollout.multiturn import TemplateGlue, turn_seed
from tandem.rollout.types import Completion, SamplingParams
from tandem.server import openai_protocol as O
from tandem.server.openai_serving import OpenAIServing, _characters, _template_message, _usage


class UnknownSession(LookupError):
    """No open session by that id (never opened, closed, or another run's): 404."""


class SessionLimit(ValueError):
    """The session reached one of its bounds (Bounds): 400."""


@dataclass(frozen=True)
class Bounds:
    """What one session may ask for; a request past any is refused, naming it."""

    max_turns: int  # requests
    max_tokens: int  # max_completion_length: tokens after a row's prompt, the model's and the inserted ones
    max_prompt: int | None = None  # max_prompt_length: tokens of a row's prompt (its first request, rendered)
    max_context: int | None = None  # the model's context (max_position_embeddings): prompt and completion


@dataclass
class Row:
    """One training row: a prompt, then the model's tokens (mask 1) and inserted ones (mask 0)."""

    prompt_ids: list[int]
    prompt_length: int  # messages in its prompt: what follows them is what reward functions see
    tools: list | None  # the tools its prompt was rendered with: other tools start another row
    messages: list = field(default_factory=list)  # the conversation so far, as the template takes it
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # of each model turn
    finish: str = "stop"
    rewrites: int = 0  # turns whose whole conversation the template renders otherwise (multiturn's metric)
    chat: bool = True  # made by /v1/chat/completions (else /v1/completions, on token ids)

    def last_turn(self) -> list[int]:
        """The model's last turn: the run of mask 1 at the end (all of ids after the first turn,
        where nothing is inserted yet: it counted 0 there, and the glue wrote a second
        <|im_end|> after the model's own)."""
        n = next((k for k, m in enumerate(reversed(self.mask)) if not m), len(self.mask))
        return self.ids[len(self.ids) - n :] if n else []


@dataclass
class Turn:
    """What one request generates from: its row (new or continued), the tokens inserted before
    the model's answer, and the answer's token budget."""

    row: Row
    inserted: list[int]
    new_messages: list
    room: int

    @property
    def context(self) -> list[int]:
        return self.row.prompt_ids + self.row.ids + self.inserted


# (token ids, max tokens, seed) -> the engine's completion, generated with the round's weights
Submit = Callable[[list[int], int, int, str | None], Awaitable[Completion]]  # ids, max_tokens, seed, grammar


class Session:
    def __init__(self, sid: str, seed: int, submit: Submit, bounds: Bounds):
        self.id, self.seed, self.submit, self.bounds = sid, seed, submit, bounds
        self.rows: list[Row] = []
        self.turns = 0
        self.limited = False  # a bound refused a request: the agent's failure after it is the bound's
        self.engine_error: BaseException | None = None  # the engine failed under it: the round fails, not the agent
        self.closed = False
        self.lock = asyncio.Lock()  # one turn at a time: a request waits for the one before it
        self._guard = threading.Lock()  # rows are read by the trainer's thread once closed

    def chat_turn(self, messages: list, tools: list | None, render: Callable[[], list[int]], glue: Callable[[list | None], TemplateGlue]) -> Turn:
        row = self.rows[-1] if self.rows else None
        if row is not None and row.chat and row.tools == tools and _extends(row.messages, messages):
            new = messages[len(row.messages) :]
            turn_text = glue(tools).tokenizer.decode(row.last_turn(), skip_special_tokens=False)
            return self._turn(row, glue(tools).inserted(turn_text, new), new)
        row = Row(render(), len(messages), tools, messages=list(messages))
        return self._turn(self._start(row), [], [])

    def text_turn(self, prompt: list[int]) -> Turn:
        row = self.rows[-1] if self.rows else None
        if row is not None and not row.chat:
            so_far = row.prompt_ids + row.ids
            if len(prompt) > len(so_far) and prompt[: len(so_far)] == so_far:
                return self._turn(row, prompt[len(so_far) :], [])
        return self._turn(self._start(Row(list(prompt), 0, None, chat=False)), [], [])

    def _start(self, row: Row) -> Row:
        with self._guard:
            self._check_open()
            self.rows.append(row)
        return row

    def _turn(self, row: Row, inserted: list[int], new_messages: list) -> Turn:
        b = self.bounds
        context = len(row.prompt_ids) + len(row.ids) + len(inserted)
        if self.turns >= b.max_turns:
            self._limit(row, f"this session has had max_turns={b.max_turns} requests")
        if b.max_context is not None and context >= b.max_context:
            self._limit(row, f"the conversation is {context} tokens, as many as the model's context ({b.max_context}, its "
                             "max_position_embeddings) holds or more")  # fmt: skip
        if b.max_prompt is not None and len(row.prompt_ids) > b.max_prompt:
            self._limit(row, f"the prompt is {len(row.prompt_ids)} tokens, past max_prompt_length={b.max_prompt}")
        room = b.max_tokens - len(row.ids) - len(inserted)
        if room < 1:
            self._limit(row, f"this conversation has reached max_completion_length={b.max_tokens} tokens after its prompt")
        self.turns += 1
        return Turn(row, inserted, new_messages, min(room, b.max_context - context) if b.max_context else room)

    def _limit(self, row: Row, why: str) -> None:
        self.limited, row.finish = True, "length"
        raise SessionLimit(f"{why}; the agent's episode ends here")

    async def generate(self, turn: Turn, limit: int | None, grammar: str | None = None) -> Completion:
        seed = turn_seed(self.seed, self.turns - 1)
        try:
            return await self.submit(turn.context, min(limit or turn.room, turn.room), seed, grammar)
        except Exception as exc:  # the engine's: the round fails with it (never an agent's error)
            self.engine_error = exc
            raise

    def record(self, turn: Turn, out: Completion, ids: list[int], reply: dict, glue: TemplateGlue | None, finish: str) -> None:
        """The turn's inserted tokens and the model's answer (`ids`, the engine's tokens up to
        where the answer ends) join its row; `reply`, the answer as the client gets it; `finish`
        its finish reason as answered (a turn cut at a stop string is `stop`, whatever the
        engine's was)."""
        with self._guard:
            if self.closed:
                return  # the agent's episode was ended meanwhile: nothing more joins it
            row = turn.row
            if glue is not None and turn.new_messages:  # checked where messages are inserted, as multi-turn does
                row.rewrites += glue.rewrites(turn.context, row.messages + turn.new_messages)
            row.ids += turn.inserted + ids
            row.logprobs += [0.0] * len(turn.inserted) + list(out.logprobs[: len(ids)])
            row.mask += [0] * len(turn.inserted) + [1] * len(ids)
            row.versions.append(out.version)
            row.messages += turn.new_messages + [reply]
            full = len(row.ids) >= self.bounds.max_tokens
            row.finish = "length" if finish == "length" or (full and finish != "stop") else "stop"

    def close(self) -> list[Row]:
        with self._guard:
            self.closed = True
            return list(self.rows)

    def _check_open(self) -> None:
        if self.closed:
            raise UnknownSession(f"session {self.id} is closed")


def _extends(before: list, messages: list) -> bool:
    """Whether `messages` continue the conversation `before` unchanged, with something new."""
    return len(messages) > len(before) and all(_same(a, b) for a, b in zip(before, messages))


def _same(a: dict, b: dict) -> bool:
    """Two messages alike for the template: role, text, and the tool calls' names and arguments
    (the ids a client keeps or drops are not rendered)."""

    def key(m: dict) -> tuple:
        calls = [(c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True)) for c in m.get("tool_calls") or []]
        return m["role"], m.get("content") or "", calls

    return key(a) == key(b)


class SessionStore:
    """The open sessions of one run, by an id that cannot be guessed."""

    def __init__(self):
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, seed: int, submit: Submit, bounds: Bounds) -> Session:
        session = Session(secrets.token_urlsafe(18), seed, submit, bounds)
        with self._lock:
            self._sessions[session.id] = session
        return session

    def get(self, sid: str) -> Session:
        with self._lock:
            session = self._sessions.get(sid)
        if session is None or session.closed:
            raise UnknownSession(f"no open session {sid[:8]}...: it was never opened here, or its trajectory has ended")
        return session

    def close(self, sid: str) -> list[Row]:
        with self._lock:
            session = self._sessions.pop(sid)
        return session.close()


class SessionServing(OpenAIServing):
    """The OpenAI-compatible endpoint inside sessions: every request is a turn of its session,
    sampled as the run samples and generated with the round's weights (Session.submit)."""

    def __init__(self, store: SessionStore, tokenizer, model_name: str, params: SamplingParams, template_kwargs: dict, tool_parser: str,
                 max_context: int | None = None):  # fmt: skip
        """`max_context`: the tokens the model's context holds (its max_position_embeddings)."""
        super().__init__(None, model_name, tool_parser, template_kwargs)
        self.store, self.tokenizer, self.params, self.max_context = store, tokenizer, params, max_context
        # By the tools a request declares: agents that send a list of their own each (one per
        # task) grew the trainer by 250 MB a step while this was unbounded.
        self._glues: OrderedDict[str, TemplateGlue] = OrderedDict()

    GLUES = 16  # tool lists whose glue is kept

    def context(self) -> int | None:
        return self.max_context

    def vocab(self) -> int:
        return len(self.tokenizer)

    def glue(self, tools: list | None) -> TemplateGlue:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._glues:
            kwargs = {**self.template_kwargs, **({"tools": tools} if tools else {})}
            self._glues[key] = TemplateGlue(self.tokenizer, kwargs, f"the model {self.model_name}")
            while len(self._glues) > self.GLUES:
                self._glues.popitem(last=False)
        self._glues.move_to_end(key)
        return self._glues[key]

    async def session_chat(self, sid: str, req: O.ChatCompletionRequest) -> O.ChatCompletion:
        session = self.store.get(sid)
        self._check_sampling(req)
        self.check_size(_characters(req), len(req.messages))
        messages = [_template_message(m) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        async with session.lock:
            turn = await self.rendered(session.chat_turn, messages, tools, lambda: self.chat_prompt(req), self.glue)
            out = await session.generate(turn, req.limit(), await self.rendered(self.grammar, req))
            prompt = turn.context  # before record() joins the answer to the row
            choice = self._chat_choice(0, out, req, bool(req.tools) and req.tool_choice != "none")
            finish = "length" if choice.finish_reason == "length" else "stop"  # tool_calls: the turn stopped
            session.record(turn, out, choice.token_ids, _template_message(O.Message(**choice.message.model_dump())), self.glue(tools), finish)
        return self._chat_response(req, prompt, [choice], out.version)

    async def session_responses(self, sid: str, req: O.ResponsesRequest) -> O.Response:
        """The Responses API in a session: its request as chat's, so it is recorded as chat is."""
        chat = req.chat(self.earlier(req))
        return self.as_response(req, chat, await self.session_chat(sid, chat))

    async def session_complete(self, sid: str, req: O.CompletionRequest) -> O.Completion:
        session = self.store.get(sid)
        self._check_sampling(req)
        prompt = await self.text_prompt(req)
        async with session.lock:
            turn = session.text_turn(prompt)
            out = await session.generate(turn, req.limit())
            prompt = turn.context  # before record() joins the answer to the row
            choice = self._text_choice(0, out, req)
            session.record(turn, out, choice.token_ids, {"role": "assistant", "content": choice.text}, None, choice.finish_reason)
        return O.Completion(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=req.model, choices=[choice],
                            usage=_usage(prompt, [choice]), prompt_token_ids=prompt, version=out.version)  # fmt: skip

    def _check_sampling(self, req) -> None:
        """A session samples as the run does: its behaviour log-probs must be the policy's at the
        run's temperature, and its seeds the run's, for the loss and for reproducibility."""
        run = self.params
        asked = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
                 "repetition_penalty": req.repetition_penalty}  # fmt: skip
        for name, value in asked.items():
            if value is not None and value != getattr(run, name):
                raise ValueError(f"{name}={value}: a training session samples at the run's {name}={getattr(run, name)} "
                                 "(its log-probs are what the loss corrects against); leave it out")  # fmt: skip
        asked = getattr(req, "chat_template_kwargs", None) or {}
        if any(self.template_kwargs.get(k) != v for k, v in asked.items()):
            raise ValueError(f"chat_template_kwargs={asked}: a training session renders with the run's chat_template_kwargs "
                             f"({self.template_kwargs}); leave it out or send those")  # fmt: skip
        if req.n != 1:
            raise ValueError("n: a training session is one trajectory, one choice per request; open more sessions for more samples")
        if req.seed is not None:
            raise ValueError("seed: a training session draws from the run's seeds (reproducible from the run's seed); leave it out")
