"""Constrained decoding: a grammar masks the logits each token is drawn from, so that an answer is
a tool call, or JSON of a schema, by construction (OpenAI's `tool_choice: "required"` or a named
function, `response_format` json_object or json_schema).

A grammar is text in llguidance's dialect of Lark, JSON schemas embedded as `%json {...}`: it
travels in SamplingParams.grammar to either engine, the transformers engine masks with llguidance
itself (Masks), the vLLM engine through its structured outputs' guidance backend. llguidance, not
xgrammar, by measurement (bench/constrained.py, docs/agents.md): it installs with no dependency
(xgrammar brings triton, a gigabyte, on every Linux install), compiles a tool-call grammar in a
tenth of the time, and both fill a row's mask in well under 1% of a decode step.

The log-probs recorded for a constrained token are of the distribution it was drawn from: log
softmax of the masked logits / temperature, renormalised over what the grammar allows. The trainer
recomputes the unconstrained policy's, so the off-policy correction sees the constraint.
"""

import functools
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# JSON written as json.dumps and HF chat templates' tojson write it, so that an answer re-renders
# to its own tokens: no free whitespace, ", " and ": " between items.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        raise ImportError("constrained decoding (tool_choice required or named, response_format json) needs llguidance: pip install llguidance") from None
    return llguidance


def json_rule(schema: dict | None) -> str:
    """A rule's body: a JSON value of `schema` (any JSON object where None), laid out as JSON_LAYOUT."""
    schema = {"type": "object"} if schema is None else dict(schema)
    schema["x-guidance"] = {**JSON_LAYOUT, **schema.get("x-guidance", {})}
    return "%json " + json.dumps(schema)


@dataclass(frozen=True)
class CallLayout:
    """How the served chat template writes an answer's tool calls around each call's JSON
    ({"name": ..., "arguments": ...}): `first` before the first, `between` between two, `last`
    after the last. Hermes' (Qwen2.5's) by default; OpenAIServing.layout reads the template's."""

    first: str = "<tool_call>\n"
    between: str = "\n</tool_call>\n<tool_call>\n"
    last: str = "\n</tool_call>"


def answer_grammar(layout: CallLayout, tools: list[dict] | None = None, one_call: bool = False, answer: dict | None = None) -> str:
    """An answer that is calls of `tools` (OpenAI function specs: name, parameters), one at most
    with `one_call`, or a JSON value of the schema `answer` ({} for any object), or either where
    both are given."""
    rules, starts = [], []
    if tools:
        for k, tool in enumerate(tools):
            call = {"type": "object", "properties": {"name": {"const": tool["name"]}, "arguments": tool.get("parameters") or {"type": "object"}},
                    "required": ["name", "arguments"], "additionalProperties": False}  # fmt: skip
            rules.append(f"call_{k}: {json_rule(call)}")
        rules.append("call: " + " | ".join(f"call_{k}" for k in range(len(tools))))
        more = "" if one_call else f" ({_literal(layout.between)} call)*"
        rules.append("calls: " + " ".join(part for part in (_literal(layout.first), "call" + more, _literal(layout.last)) if part))
        starts.append("calls")
    if answer is not None:
        rules.append(f"answer: {json_rule(answer or None)}")
        starts.append("answer")
    if not starts:
        raise ValueError("answer_grammar needs tools or an answer schema")
    return "\n".join([f"start: {' | '.join(starts)}", *rules])


def _literal(text: str) -> str:
    return json.dumps(text) if text else ""


def check(grammar: str, field: str) -> None:
    """Refuse a grammar llguidance cannot compile (a JSON schema it does not take), naming `field`."""
    error = _compile_error(grammar)
    if error:
        raise ValueError(f"{field}: cannot be enforced ({error.strip().splitlines()[0]})")


@functools.lru_cache(maxsize=256)
def _compile_error(grammar: str) -> str:
    """llguidance's error for `grammar`, "" for none: kept, since a session's request is checked by
    the serving and again by the rollout server's /generate (several ms each for a tool list)."""
    return _llguidance().LLMatcher.validate_grammar(grammar)


class Grammars:
    """What the transformers engine constrains with: the tokenizer as llguidance reads it (made
    once: 1.8 s at a vocabulary of 151,936) and the last grammars compiled, copied for each row."""

    KEPT = 64

    def __init__(self, tokenizer, vocab: int, eos_token_ids: list[int]):
        ll = _llguidance()
        self.vocab = vocab
        self.info = ll.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(eos_token_ids))
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def masks(self, grammar: str, rows: int) -> "Masks":
        with self._lock:
            first = self._compiled.get(grammar)
            if first is None:
                first = _llguidance().LLMatcher(self.info, grammar, log_level=1)
                if first.is_error():
                    raise ValueError(f"grammar: cannot be enforced ({first.get_error()})")
                self._compiled[grammar] = first
                while len(self._compiled) > self.KEPT:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(grammar)
            return Masks([first.deep_copy() for _ in range(rows)], self.vocab)


class Masks:
    """One matcher per row of a decode batch: each step masks the rows' logits to the tokens their
    grammar allows next, then advances each row by the token it drew."""

    def __init__(self, matchers: list, vocab: int):
        self.matchers, self._torch = matchers, _llguidance().torch
        self.bits = self._torch.allocate_token_bitmask(len(matchers), vocab)  # (N, ceil(V / 32)) int32

    def apply(self, logits: torch.Tensor, done: torch.Tensor) -> None:
        """-inf, in place, on each live row's logits (M, V) where its grammar forbids the token; a
        done row is left as it is (its token is padding)."""
        bits = self.bits[: len(logits)]
        for i, (matcher, finished) in enumerate(zip(self.matchers, done.tolist())):
            if finished:
                bits[i] = -1
            else:
                self._torch.fill_next_token_bitmask(matcher, bits, i)
        _apply(logits, bits.to(logits.device))

    def advance(self, tokens: torch.Tensor, done: torch.Tensor) -> None:
        for matcher, token, finished in zip(self.matchers, tokens.tolist(), done.tolist()):
            if not finished and not matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused token {token} it allowed ({matcher.get_error()})")

    def keep(self, rows: list[int]) -> None:
        self.matchers = [self.matchers[i] for i in rows]


_compiled_apply = True  # llguidance's kernel (torch.compile) until it fails to compile here


def _apply(logits: torch.Tensor, bits: torch.Tensor) -> None:
    """-inf where a bit of `bits` (M, ceil(V / 32)) is 0. llguidance's kernel is torch.compiled
    (1.4 ms for 8 rows of 151,936 on one core, against 10-20 for any eager formulation tried):
    where compiling fails (no C++ compiler for inductor on a CPU, no triton on a GPU) the same
    mask is applied eagerly, with a warning."""
    global _compiled_apply
    if _compiled_apply:
        try:
            _llguidance().torch.apply_token_bitmask_inplace(logits, bits)
            return
        except Exception as exc:  # noqa: BLE001 - torch.compile's failures have no common type
            _compiled_apply = False
            log.warning(f"constrained decoding: llguidance's compiled mask kernel failed ({type(exc).__name__}: {str(exc)[:200]}); "
                        "masking eagerly instead, about 10x slower")  # fmt: skip
    apply_eagerly(logits, bits)


def apply_eagerly(logits: torch.Tensor, bits: torch.Tensor) -> None:
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(len(bits), -1)[:, : logits.shape[1]]  # (M, V)
    logits.masked_fill_(allowed == 0, float("-inf"))
