"""Generation engines behind one small interface. The transformers engine comes first."""

from contextlib import contextmanager
from typing import Callable, Protocol

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from tandem.attention import TANDEM_SDPA
from tandem.linears import fast_linears
from tandem.rollout.grammar import Grammars
from tandem.rollout.sampling import Workspace, apply_repetition_penalty, chosen_logprobs, filter_logits, row_generators, sample, scaled_into
from tandem.rollout.types import Completion, SamplingParams
from tandem.rollout.weights import check_weights, fingerprint


def eos_token_ids(tokenizer, generation_config, where: str) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(generation_config, "eos_token_id", None)
    ids |= set(gen_eos) if isinstance(gen_eos, list) else {gen_eos}
    ids.discard(None)
    if not ids:
        raise ValueError(f"{where}: neither the tokenizer nor generation_config names an EOS token")
    return sorted(ids)



@contextmanager
def eval_mode(model: torch.nn.Module):
    """`model` in eval mode inside (no dropout), back in the mode it was in after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)

class Engine(Protocol):
    """What the producer and the rollout server need from an engine."""

    version: int  # number of weight updates received
    # How many generate() calls may run at once. 1: the engine batches a call's sequences itself,
    # so the server merges waiting requests into one call. More: the engine batches continuously
    # across calls (vLLM), so each request goes in as it arrives.
    max_concurrency: int
    threads: int  # CPU threads it keeps busy while generating: a trainer on the same host leaves them free

    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], min_version: int = 0) -> list[Completion]:
        """One completion per prompt; prompt i is sampled with its own seed seeds[i], with weights
        of policy version >= min_version."""
        ...

    def weight_spec(self) -> dict[str, torch.Tensor]:
        """The weights a trainer pushes, by name: tensors (possibly on the meta device) that give
        each one's shape and the dtype the engine holds it in."""
        ...

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Replace every weight; checks all names and shapes before changing anything. Never
        called while a generate() call runs."""
        ...

    def base_weights(self) -> dict[str, torch.Tensor]:
        """The full weights live now, by weight_spec's names, as tensors the caller may keep: an
        adapter update is merged into them (load_weights never changes them in place)."""
        ...

    def fingerprint(self) -> str:
        """weights.fingerprint of the weights last loaded, as received, in the engine's dtype."""
        ...

    def close(self) -> None:
        """Release what the engine holds beyond this process's memory (processes, devices)."""
        ...


def check_request(engine: Engine, prompts: list[list[int]], params: SamplingParams, seeds: list[int], min_version: int) -> None:
    """The checks every engine makes before generating."""
    if engine.version < min_version:
        raise RuntimeError(f"the engine holds version {engine.version}, the request needs >= {min_version}")
    params.validate()
    if len(prompts) != len(seeds):
        raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds; give one seed per prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")


def seed_bits(seed: int) -> int:
    """A completion's seed as the engines' generators take it (48 bits, the same on every engine)."""
    return int(seed) & 0xFFFF_FFFF_FFFF


class _GrowingLayer(DynamicLayer):
    """One layer's keys and values in buffers as long as the whole sequence will be, filled as it
    grows: a decode step writes its own token's, where DynamicLayer copies the whole cache to
    append one (a third of the decode loop's time on the `small` model, docs/benchmarks.md), and
    attention reads the filled part as a view."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.key_buffer = key_states.new_empty((*key_states.shape[:2], self.capacity, key_states.shape[-1]))
            self.value_buffer = value_states.new_empty((*value_states.shape[:2], self.capacity, value_states.shape[-1]))
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"the decode cache holds {self.capacity} tokens, a step needs {end}")
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def reorder_cache(self, rows: torch.Tensor) -> None:
        """Keep (and repeat) the sequences `rows`: prompts to their completions, or the live ones."""
        self.key_buffer, self.value_buffer = self.key_buffer.index_select(0, rows), self.value_buffer.index_select(0, rows)
        self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]


def decode_cache(config, capacity: int) -> Cache:
    """A KV cache for decoding sequences of at most `capacity` tokens: preallocated where every
    layer is plain full attention, transformers' own (sliding windows, hybrid models) otherwise."""
    cache = DynamicCache(config=config)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return cache
    return Cache(layers=[_GrowingLayer(capacity) for _ in cache.layers])


@contextmanager
def decode_attention(model: torch.nn.Module):
    """The model's attention for a call of the engine: a CPU model on transformers' sdpa decodes
    through tandem_sdpa (tandem.attention: a decode step's query heads folded); everything else
    as it is. Set back after the call: the model is left as it came (a colocated trainer's
    model runs on tandem_sdpa already)."""
    config = getattr(model, "config", None)
    swap = config is not None and config._attn_implementation == "sdpa" and next(model.parameters()).device.type == "cpu"
    if swap:
        config._attn_implementation = TANDEM_SDPA
    try:
        yield
    finally:
        if swap:
            config._attn_implementation = "sdpa"


# Decoding at least this many tokens packs the large weights for oneDNN first (tandem.linears):
# at the Qwen2.5-0.5B shape packing takes about 1 s, what about 22 decode steps of 8 rows save.
# Not a sharded model's: it gathers its weights anew at every forward, so it would pack them at
# every step.
PACK_MIN_TOKENS = 64


class TransformersEngine:
    """Batched sampling with a KV cache on any transformers causal LM.

    The decode loop is written out instead of calling `model.generate` so that each sequence
    samples from its own seeded generator (reproducible whatever the batch holds), and so that
    the behaviour log-probs are exactly log softmax(logits / temperature) of the sampled tokens,
    the quantity the trainer recomputes: top-k, top-p, min-p and the repetition penalty choose
    which tokens may be drawn, they do not change the recorded log-probs. A grammar
    (SamplingParams.grammar, rollout.grammar) does: it masks the logits first, so a constrained
    token's log-prob is of the masked distribution it was drawn from.
    """

    max_concurrency = 1

    def __init__(self, model: torch.nn.Module, eos_token_ids: list[int], pad_token_id: int, version: int = 0, all_done: Callable[[bool], bool] | None = None,
                 keep_packed: bool = False, tokenizer=None):  # fmt: skip
        """`all_done` (a sharded model, whose every forward is a collective): given whether this
        process's sequences are all finished, whether every process's are; decoding goes on, on
        finished rows, until they are, so every process makes the same forward calls.
        `keep_packed` (an engine that only generates: the rollout server's): the weights packed
        for oneDNN are kept from one generate call to the next until new weights load, so that a
        round's batches and turns pack them once (0.35 s a call at the Qwen2.5-0.5B shape). A
        colocated engine packs per call: its packed copy would sit beside the training step.
        `tokenizer`: the model's, which a grammar (SamplingParams.grammar) is compiled against;
        an engine made without it refuses a constrained call."""
        if not eos_token_ids:
            raise ValueError("the engine needs at least one EOS token id to know when a completion stops")
        self.model = model
        self.all_done = all_done
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.version = version
        self.keep_packed = keep_packed and all_done is None
        self._packed = None  # the kept packing mode (keep_packed), made by the first call that packs
        # The process's torch threads when it was made (a server's --threads), not a call's: a
        # server lends a sync run's calls more (RolloutService._call)
        self.threads = torch.get_num_threads()
        self.tokenizer = tokenizer
        self._grammars: Grammars | None = None  # made by the first constrained call

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def weight_spec(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def base_weights(self) -> dict[str, torch.Tensor]:
        # load_weights adopts new tensors (or copies into a weight whose dtype differs, which
        # merged weights never do: they come in the base's dtype), so these are left as they are.
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def fingerprint(self) -> str:
        # Loading adopts the received tensors (or casts them into the weights), so the live
        # weights are the received ones in the engine's dtype.
        return fingerprint(self.model.named_parameters())

    def close(self) -> None:
        pass  # the model is the caller's (the colocated trainer's) or the process's

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        check_weights(params, weights, complete=True)
        self._packed = None  # the old weights' packed copies go before the new ones arrive
        for name, t in weights.items():
            p = params[name]
            if t.dtype == p.dtype and t.device == p.device:
                # Adopt the received buffer instead of copying it: the update becomes live at once
                # and no second copy of the weights is made. Tied weights share one Parameter, so
                # both names see it.
                p.data = t
            else:
                p.copy_(t)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], min_version: int = 0) -> list[Completion]:
        check_request(self, prompts, params, seeds, min_version)
        idle = not prompts
        if idle and self.all_done is None:
            return []
        if idle:  # sharded: nothing of its own to generate, it still takes part in every other process's forward calls
            prompts, seeds = [[self.pad_token_id]], [0]
        with eval_mode(self.model), decode_attention(self.model), self._linears(params.max_tokens):
            out = self._generate(prompts, params, seeds, idle)
        return [] if idle else out

    def _masks(self, params: SamplingParams, rows: int):
        """The grammar's masks for a call's rows (rollout.grammar), None for free text."""
        if params.grammar is None:
            return None
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("sampling.grammar: this engine was made without the model's tokenizer, which constrained decoding needs")
            self._grammars = Grammars(self.tokenizer, self.model.get_output_embeddings().weight.shape[0], self.eos_token_ids)
        return self._grammars.masks(params.grammar, rows)

    def _linears(self, max_tokens: int):
        """How the large weights' matmuls run for a call (tandem.linears): packed where the call
        decodes enough tokens to pay for packing them, or where the packs are kept."""
        if not self.keep_packed:
            return fast_linears(self.model, pack=max_tokens >= PACK_MIN_TOKENS and self.all_done is None, layers=True)
        if self._packed is None:
            self._packed = fast_linears(self.model, pack=True, layers=True)
        return self._packed

    def _generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], idle: bool = False) -> list[Completion]:
        """`idle`: the prompts are a stand-in, done from the start (see generate)."""
        device = self.device
        n, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)  # (N, P), left-padded
        attention = torch.zeros((n, width), dtype=torch.long)  # (N, P)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)  # (N, P)
        generators = row_generators([seed_bits(s) for s in seeds], device)
        vocab = self.model.get_output_embeddings().weight.shape[0]
        seen = torch.zeros((n, vocab), dtype=torch.bool, device=device)  # (N, V) for the repetition penalty
        if params.repetition_penalty != 1.0:
            seen.scatter_(1, input_ids, attention.bool())
        cache, logits = self._prefill(prompts, input_ids, attention, positions, params.max_tokens)
        token_mat, logp_mat, lengths, finished_by_eos = self._decode(cache, logits, attention, positions[:, -1:], seen, generators, params, idle)
        token_mat, logp_mat, lengths, finished_by_eos = token_mat.cpu(), logp_mat.cpu(), lengths.tolist(), finished_by_eos.tolist()
        return [
            Completion(
                token_ids=token_mat[i, : lengths[i]].tolist(),
                logprobs=logp_mat[i, : lengths[i]].tolist(),
                finish_reason="stop" if finished_by_eos[i] else "length",
                version=self.version,
            )
            for i in range(n)
        ]

    def _prefill(self, prompts, input_ids, attention, positions, max_tokens: int):
        """Prefill each distinct prompt once (a group's G completions share one), then give every
        sequence its own copy of the prompt's KV cache; returns it and the first logits (N, V)."""
        keys: dict[tuple, int] = {}
        rows = []  # one row holding each distinct prompt
        for i, p in enumerate(prompts):
            if tuple(p) not in keys:
                keys[tuple(p)] = len(keys)
                rows.append(i)
        index = torch.tensor([keys[tuple(p)] for p in prompts], device=self.device)  # (N,)
        first = torch.tensor(rows, device=self.device)  # (U,)
        out = self.model(
            input_ids=input_ids[first], attention_mask=attention[first], position_ids=positions[first],
            past_key_values=decode_cache(self.model.config, input_ids.shape[1] + max_tokens), use_cache=True, logits_to_keep=1,
        )
        cache = out.past_key_values
        cache.reorder_cache(index)  # (U, ...) -> (N, ...)
        return cache, out.logits[:, -1, :].float()[index]  # (N, V)

    def _decode(self, cache, logits, attention, step_pos, seen, generators, params: SamplingParams, idle: bool = False):
        """Sample until every sequence stopped or reached max_tokens: tokens and log-probs (N, T),
        lengths and whether each ended on EOS (N,). The batch holds only sequences still
        generating: once a quarter of its rows have stopped, they leave it, KV cache included, so
        no decode step computes a finished one. `idle`: every row counts as stopped from the start."""
        device, n = self.device, len(logits)
        eos = torch.tensor(self.eos_token_ids, device=device)
        live = torch.arange(n, device=device)  # (M,) the sequence each batch row holds
        token_mat = torch.full((n, params.max_tokens), self.pad_token_id, dtype=torch.long, device=device)  # (N, T)
        logp_mat = torch.zeros((n, params.max_tokens), device=device)  # (N, T)
        lengths = torch.full((n,), params.max_tokens, dtype=torch.long, device=device)  # (N,)
        finished_by_eos = torch.zeros(n, dtype=torch.bool, device=device)  # (N,)
        done = torch.full((n,), idle, dtype=torch.bool, device=device)  # (M,)
        # Reused at every step: a fresh (N, V) tensor is fresh pages to fault in (sampling.Workspace).
        work, logits_f32 = Workspace(n, logits.shape[-1], device), torch.empty_like(logits)
        masks = self._masks(params, n)
        for step in range(params.max_tokens):
            if masks is not None:  # before everything else: what may be drawn, and what the log-probs are of
                masks.apply(logits, done)
            penalised = apply_repetition_penalty(logits, seen, params.repetition_penalty)
            scores = scaled_into(penalised, params.temperature, work)  # (M, V)
            tok = sample(filter_logits(scores, params.top_k, params.top_p, params.min_p), generators, work)  # (M,)
            tok = torch.where(done, torch.full_like(tok, self.pad_token_id), tok)
            if penalised is not logits:  # the log-probs are of the scores before the penalty
                scores = scaled_into(logits, params.temperature, work)
            lp = chosen_logprobs(scores, tok, work)  # (M,), as token_logprobs
            if masks is not None:
                masks.advance(tok, done)
            token_mat[live, step] = tok
            logp_mat[live, step] = lp
            hit_eos = torch.isin(tok, eos) & ~done  # (M,)
            finished_by_eos[live[hit_eos]] = True
            lengths[live[hit_eos]] = step + 1
            done |= hit_eos
            if params.repetition_penalty != 1.0:
                seen[torch.arange(len(live), device=device), tok] = True
            if step == params.max_tokens - 1 or self._all_finished(done):
                break
            if 4 * int(done.sum()) >= len(done) and not done.all():  # a finished batch keeps its rows while others decode
                keep = (~done).nonzero().squeeze(1)  # (M',)
                cache.reorder_cache(keep)
                live, tok, done, attention, step_pos, seen = live[keep], tok[keep], done[keep], attention[keep], step_pos[keep], seen[keep]
                generators = [generators[i] for i in keep.tolist()]
                if masks is not None:
                    masks.keep(keep.tolist())
            # the next token's logits, one decode step on the cache
            step_pos = step_pos + 1  # (M, 1)
            attention = torch.cat([attention, torch.ones((len(live), 1), dtype=attention.dtype, device=device)], dim=1)
            out = self.model(
                input_ids=tok.unsqueeze(1), attention_mask=attention, position_ids=step_pos, past_key_values=cache, use_cache=True, logits_to_keep=1
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :]  # (M, V)
            logits = logits if logits.dtype == torch.float32 else logits_f32[: len(live)].copy_(logits)
        return token_mat, logp_mat, lengths, finished_by_eos

    def _all_finished(self, done: torch.Tensor) -> bool:
        """Whether decoding can stop: every sequence here is done, and with `all_done` (sharded)
        every process's, so that all of them make the same forward calls."""
        finished = bool(done.all())
        return self.all_done(finished) if self.all_done is not None else finished
