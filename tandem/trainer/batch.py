"""Training micro-batches, and the forward pass that computes each prompt once per group.

The G completions of a prompt share it. The forward runs the distinct prompts once with a KV
cache, gathers that cache to one row per completion (index_select, so gradients from every
completion flow back into the one prompt computation), then runs the completion tokens against
it. On the demo task (25-token prompts, 3-token completions, G=8) that is 3.5x less work than
running every prompt+completion sequence in full, with the same result up to float rounding
(a float64 model gives the same log-probs exactly, and gradients within 1e-6 relative; see
tests/test_trainer_parts.py).
"""

from dataclasses import dataclass

import torch
from torch import nn

from tandem.algo import entropy_from_logits, token_logprobs
from tandem.rollout.types import Rollout


@dataclass
class MicroBatch:
    prompt_ids: torch.Tensor  # (U, P): the U distinct prompts, left-padded
    prompt_mask: torch.Tensor  # (U, P)
    prompt_index: torch.Tensor  # (n,): which distinct prompt each completion continues
    completion_ids: torch.Tensor  # (n, C), right-padded
    completion_attention: torch.Tensor  # (n, C): 1 on real completion tokens
    completion_mask: torch.Tensor  # (n, C) float: 1 on tokens the loss covers


def collate(rollouts: list[Rollout], pad_id: int, device, mask_truncated: bool) -> MicroBatch:
    keys: dict[tuple, int] = {}
    index = [keys.setdefault(tuple(r.prompt_ids), len(keys)) for r in rollouts]
    prompts = list(keys)
    U, P = len(prompts), max(len(p) for p in prompts)
    n, C = len(rollouts), max(1, max(len(r.completion_ids) for r in rollouts))
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
    if mask_truncated:
        loss_mask[torch.tensor([r.truncated for r in rollouts])] = 0
    return MicroBatch(
        prompt_ids=prompt.to(device),
        prompt_mask=prompt_mask.to(device),
        prompt_index=torch.tensor(index).to(device),
        completion_ids=completion.to(device),
        completion_attention=attention.to(device),
        completion_mask=loss_mask.float().to(device),
    )


class PrefixSharingLM(nn.Module):
    """Wraps a causal LM so that one call computes the completion logits of a MicroBatch. One
    module call keeps DDP to one forward per backward, though the prompts and the completions
    are two passes through the model."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        """Logits (n, C, V): position t predicts completion token t."""
        idx = mb.prompt_index  # (n,)
        positions = (mb.prompt_mask.cumsum(-1) - 1).clamp(min=0)  # (U, P), as the engine numbered them
        out = self.lm(input_ids=mb.prompt_ids, attention_mask=mb.prompt_mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        logits = [out.logits[:, -1:, :][idx]]  # (n, 1, V): the last prompt position predicts token 0
        C = mb.completion_ids.shape[1]
        if C > 1:
            cache = out.past_key_values
            cache.reorder_cache(idx)  # (U, ...) -> (n, ...), differentiable
            lengths = mb.prompt_mask.sum(-1)[idx]  # (n,)
            rest = self.lm(
                input_ids=mb.completion_ids[:, :-1],  # (n, C-1)
                attention_mask=torch.cat([mb.prompt_mask[idx], mb.completion_attention[:, :-1]], dim=1),  # (n, P + C-1)
                position_ids=lengths.unsqueeze(1) + torch.arange(C - 1, device=idx.device),  # (n, C-1)
                past_key_values=cache,
                use_cache=True,
            ).logits  # (n, C-1, V)
            logits.append(rest)
        return torch.cat(logits, dim=1)


def completion_logprobs(model: nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool = False):
    """Per-token log-probs (n, C) of the completion tokens, and their entropy (n, C) if asked.
    `model` is a PrefixSharingLM (possibly inside DDP)."""
    logits = model(mb)  # (n, C, V)
    logps = token_logprobs(logits.float(), mb.completion_ids, temperature)  # (n, C)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits, temperature)  # (n, C)
    return logps, entropy
