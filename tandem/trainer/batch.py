"""Training micro-batches, and the forward pass that computes each prompt once per group and
little padding past the ends of completions.

The G completions of a prompt share it. The forward runs the distinct prompts once with a KV
cache, gathers that cache to one row per completion (index_select, so gradients from every
completion flow back into the one prompt computation), then runs the completion tokens against
it. On the demo task (25-token prompts, 3-token completions, G=8) that is 3.5x less work than
running every prompt+completion sequence in full, with the same result up to float rounding
(a float64 model gives the same log-probs exactly, and gradients within 1e-6 relative; see
tests/test_trainer_parts.py).

Completions of one micro-batch end at different lengths (a mean of 35 of 64 tokens is typical),
so padding them all to the longest would spend about half the forward and backward on padding.
The completions are instead run in a few buckets of similar length, each padded only to its own
longest (length_buckets chooses them). On 64 completions of mean length 25 of 64, 1958 tokens
run for 1589 real ones instead of 4096, and forward + backward take half the time
(bench/train_forward.py).
"""

import functools
import sys
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer

from tandem.attention import use_tandem_attention
from tandem.rollout.types import Rollout
from tandem.trainer.head import head_logprobs

# Each bucket is one more forward and backward call through the model, with a fixed cost that it
# must earn back (on the `small` model on 2 cores, about the work of 100 tokens): one more bucket
# is taken only where it saves more than BUCKET_COST padded tokens, and never more than
# MAX_BUCKETS (past 4 they gained nothing measurable; bench/train_forward.py).
MAX_BUCKETS = 4
BUCKET_COST = 64


def length_buckets(lengths: list[int], max_buckets: int = MAX_BUCKETS, bucket_cost: int = BUCKET_COST, exactly: int | None = None) -> list[list[int]]:
    """Split sequences into at most `max_buckets` groups, each padded to its own longest, so that
    tokens run plus `bucket_cost` per group are fewest (the fewest groups among equal splits);
    or into `exactly` groups (at most len(lengths)) with the fewest tokens. An exact dynamic
    program over the lengths sorted longest first, where an optimal split is contiguous.
    Returns the indices of each group, longest group first."""
    n = len(lengths)
    order = sorted(range(n), key=lambda i: -lengths[i])
    width = torch.tensor([lengths[i] for i in order], dtype=torch.float64)  # (n,), descending
    i, j = torch.arange(n, dtype=torch.float64).unsqueeze(1), torch.arange(n + 1, dtype=torch.float64).unsqueeze(0)
    # cost[i, j]: tokens of one group holding sorted sequences i..j-1, all padded to i's length
    cost = torch.where(j > i, (j - i) * width.unsqueeze(1), torch.inf)  # (n, n + 1)
    best = torch.full((n + 1,), torch.inf, dtype=torch.float64)  # best[j]: fewest tokens for sequences 0..j-1 ...
    best[0] = 0.0  # ... in exactly k groups; k = 0 here
    starts, totals = [], []
    for _ in range(min(exactly or max_buckets, n)):
        best, start = (best[:n].unsqueeze(1) + cost).min(dim=0)  # (n + 1,): k + 1 groups, where the last one starts
        starts.append(start)
        totals.append(best[n])
    if exactly:
        k = len(totals) - 1
    else:
        k = min(range(len(totals)), key=lambda k: (totals[k] + k * bucket_cost, k)) if n else -1
    groups, end = [], n
    for level in range(k, -1, -1):  # walk back through the groups, last first
        begin = int(starts[level][end])
        groups.append(order[begin:end])
        end = begin
    return groups[::-1]


@dataclass
class MicroBatch:
    prompt_ids: torch.Tensor  # (U, P): the U distinct prompts, left-padded
    prompt_mask: torch.Tensor  # (U, P)
    prompt_index: torch.Tensor  # (n,): which distinct prompt each completion continues
    completion_ids: torch.Tensor  # (n, C), right-padded
    completion_attention: torch.Tensor  # (n, C): 1 on real completion tokens
    completion_mask: torch.Tensor  # (n, C) float: 1 on tokens the loss covers
    buckets: list[tuple[torch.Tensor, int]]  # completions of similar length run together: (rows, width)
    lockstep: bool = False  # as many forward calls as on every other rank (below)


def collate(
    rollouts: list[Rollout], pad_id: int, device, mask_truncated: bool, max_buckets: int = MAX_BUCKETS, bucket_cost: int = BUCKET_COST,
    lockstep: bool = False,
) -> MicroBatch:
    """A micro-batch of `rollouts`. With `lockstep` (a sharded model, whose every forward call is a
    collective) its forward makes the same number of model calls on every rank whatever the
    lengths: exactly min(max_buckets, n) buckets, each with its completion pass."""
    keys: dict[tuple, int] = {}
    index = [keys.setdefault(tuple(r.prompt_ids), len(keys)) for r in rollouts]
    prompts = list(keys)
    U, P = len(prompts), max(len(p) for p in prompts)
    lengths = [max(1, len(r.completion_ids)) for r in rollouts]
    n, C = len(rollouts), max(lengths)
    prompt = torch.full((U, P), pad_id, dtype=torch.long)  # (U, P)
    prompt_mask = torch.zeros((U, P), dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt[i, P - len(p) :] = torch.tensor(p)
        prompt_mask[i, P - len(p) :] = 1
    completion = torch.full((n, C), pad_id, dtype=torch.long)  # (n, C)
    attention = torch.zeros((n, C), dtype=torch.long)
    for i, r in enumerate(rollouts):
        completion[i, : len(r.completion_ids)] = torch.tensor(r.completion_ids, dtype=torch.long)
        attention[i, : len(r.completion_ids)] = 1
    loss_mask = attention.clone()
    for i, r in enumerate(rollouts):
        if r.loss_mask is not None:  # a multi-turn trajectory: its inserted tokens are out of the loss
            loss_mask[i, : len(r.loss_mask)] = torch.tensor(r.loss_mask, dtype=torch.long)
    loss_mask[torch.tensor([not r.in_loss(mask_truncated) for r in rollouts])] = 0
    return MicroBatch(
        prompt_ids=prompt.to(device),
        prompt_mask=prompt_mask.to(device),
        prompt_index=torch.tensor(index).to(device),
        completion_ids=completion.to(device),
        completion_attention=attention.to(device),
        completion_mask=loss_mask.float().to(device),
        buckets=[(torch.tensor(rows).to(device), lengths[rows[0]]) for rows in length_buckets(lengths, max_buckets, bucket_cost, max_buckets if lockstep else None)],
        lockstep=lockstep,
    )


class _PrefixLayer(DynamicLayer):
    """One layer's keys and values of the prompts. The prompt pass stores its own (made anew each
    call); a pass that continues the prompts attends over them and its own tokens without storing
    its own. Either way a second call of a layer on the same inputs gives the same result, as
    activation checkpointing needs: it calls each layer again in the backward."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        super().__init__()
        self.prefix = keys is not None
        if self.prefix:
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.prefix:
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)
        self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return key_states, value_states


def _prefix_rows(cache: Cache, rows: torch.Tensor) -> Cache:
    """The prompts' keys and values for `rows` (index_select: differentiable, so every completion's
    gradient flows back into the one prompt computation), for a pass that continues them."""
    return Cache(layers=[_PrefixLayer(layer.keys.index_select(0, rows), layer.values.index_select(0, rows)) for layer in cache.layers])


def checkpoint_layers(lm: nn.Module) -> int:
    """gradient_checkpointing: each decoder layer keeps only its inputs for the backward and runs
    again there (torch's non-reentrant checkpoint, which restores the RNG state, so dropout draws
    the same). transformers' own switch drops the KV cache that the prefix-sharing forward needs;
    this wraps the layers' forward instead, so a sharded model's hooks stay outside, and the
    cache's layers (_PrefixLayer) give the same result when called again. Returns how many
    layers it wraps; generation (no gradient) runs them as they are."""
    layers = [m for m in lm.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer.forward = functools.partial(_checkpointed, layer.forward)
    return len(layers)


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


class PrefixSharingLM(nn.Module):
    """Wraps a causal LM so that one call computes the completion log-probs of a MicroBatch. One
    module call keeps DDP to one forward per backward, though the prompts and each bucket of
    completions are separate passes through the model. The output layer runs a chunk of tokens
    at a time (head.py), on completion tokens only."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        use_tandem_attention(lm)  # for good, so that a checkpointed layer's recompute runs as its forward did

    def _hidden(self, **inputs) -> torch.Tensor:
        """The LM's last hidden states (N, T, H) for `inputs`, without its logits: the LM is called
        as a whole (a sharded root gathers its weights in its own call) with no position kept for
        the output layer."""
        hidden = []
        hook = self.lm.get_decoder().register_forward_hook(lambda module, args, out: hidden.append(out[0]))
        try:
            self.lm(**inputs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device))
        finally:
            hook.remove()
        return hidden[0]

    def forward(self, mb: MicroBatch, temperature: float, with_entropy: bool = False, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (n, C) of the completion tokens under softmax(logits / temperature), 0 past
        each completion's end, and their entropy (n, C) if asked: a metric without gradient, or
        with `entropy_grad` a term of the loss (an entropy bonus)."""
        positions = (mb.prompt_mask.cumsum(-1) - 1).clamp(min=0)  # (U, P), as the engine numbered them
        cache = Cache(layer_class_to_replicate=_PrefixLayer)
        last = self._hidden(input_ids=mb.prompt_ids, attention_mask=mb.prompt_mask, position_ids=positions, past_key_values=cache, use_cache=True)[:, -1:]  # (U, 1, H): predicts token 0
        prompt_lengths = mb.prompt_mask.sum(-1)  # (U,)
        head = self.lm.get_output_embeddings()
        n, C = mb.completion_ids.shape
        logps = torch.zeros((n, C), device=last.device)
        entropy = torch.zeros((n, C), device=last.device) if with_entropy else None
        for rows, width in mb.buckets:  # rows (n_b,), completions at most `width` long
            idx = mb.prompt_index[rows]  # (n_b,)
            hidden = last[idx]  # (n_b, 1, H)
            if width > 1 or mb.lockstep:
                fed = max(width - 1, 1)  # in lockstep a bucket of 1-token completions still makes its call
                rest = self._hidden(
                    input_ids=mb.completion_ids[rows, :fed],  # (n_b, fed)
                    attention_mask=torch.cat([mb.prompt_mask[idx], mb.completion_attention[rows, :fed]], dim=1),  # (n_b, P + fed)
                    position_ids=prompt_lengths[idx].unsqueeze(1) + torch.arange(fed, device=idx.device),  # (n_b, fed)
                    past_key_values=_prefix_rows(cache, idx),
                    use_cache=True,
                )  # (n_b, fed, H)
                hidden = torch.cat([hidden, rest[:, : width - 1]], dim=1)  # (n_b, width, H)
            r, c = mb.completion_attention[rows, :width].nonzero(as_tuple=True)  # the real tokens: bucket row, position
            lp, ent = head_logprobs(head, hidden[r, c], mb.completion_ids[rows[r], c], temperature, with_entropy, entropy_grad and torch.is_grad_enabled())
            logps = logps.index_put((rows[r], c), lp)
            if with_entropy:
                entropy = entropy.index_put((rows[r], c), ent)
        fsdp = sys.modules.get("torch.distributed.fsdp")  # a model never sharded in a run that never imported it
        if not torch.is_grad_enabled() and fsdp is not None and isinstance(self.lm, fsdp.FSDPModule):
            self.lm.reshard()  # no backward will: a sharded root keeps no gathered copy that could go stale
        return logps, entropy


def completion_logprobs(model: nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool = False, entropy_grad: bool = False):
    """Per-token log-probs (n, C) of the completion tokens, and their entropy (n, C) if asked
    (with gradient if `entropy_grad`). `model` is a PrefixSharingLM (possibly inside DDP)."""
    return model(mb, temperature, with_entropy, entropy_grad)
