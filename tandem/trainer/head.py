"""The output layer, a chunk of tokens at a time: the log-prob of each chosen token and the
entropy of its distribution, without holding the logits of every token.

At a vocabulary of 151,936 the logits of 2,048 tokens are 1.2 GB in fp32, and a log-softmax,
its gradient and the entropy's softmax each make another copy. Here the forward keeps only the
hidden states (tokens x hidden size) and computes the logits of HEAD_CHUNK_BYTES' worth of
tokens at a time; the backward computes each chunk's logits again and backpropagates through
them, one chunk at a time. The results are today's computation's up to float rounding
(tests/test_trainer_parts.py checks log-probs and every parameter's gradient within 1e-6).
"""

import torch
from torch import nn

# The fp32 logits of one chunk: 64 MiB, 110 tokens of a 151,936-token vocabulary (a few such
# buffers live at once: logits, softmax, their gradient). Larger chunks measured no faster.
HEAD_CHUNK_BYTES = 64 << 20


def chunk_tokens(vocab: int) -> int:
    return max(1, HEAD_CHUNK_BYTES // (4 * vocab))


def _chunk(head: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool):
    """Log-probs (t,) of `tokens` under softmax(head(hidden) / temperature), and the entropy (t,)
    of that distribution or None; the logits in fp32, as token_logprobs takes them."""
    scores = head(hidden).float() / temperature  # (t, V)
    chosen = scores.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scores, dim=-1)  # (t,), as token_logprobs
    if not with_entropy:
        return chosen, None
    logp = torch.log_softmax(scores, dim=-1)  # (t, V)
    return chosen, -(logp.exp() * logp).sum(-1)


class _ChunkedHead(torch.autograd.Function):
    """Inputs: hidden (T, H) and the head's trainable parameters (for their gradients); the head
    module itself, so an fp32 head, an adapter on it or a sharded model's hooks apply as in a
    plain call. Autocast as it was at the forward is restored for the backward's recompute."""

    @staticmethod
    def forward(ctx, hidden, tokens, head, temperature, with_entropy, entropy_grad, *params):
        ctx.head, ctx.temperature, ctx.with_entropy = head, temperature, with_entropy
        device = hidden.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(hidden, tokens, *params)
        step = chunk_tokens(_vocab(head))
        logps, entropies = [], []
        for s in range(0, len(hidden), step):
            lp, ent = _chunk(head, hidden[s : s + step], tokens[s : s + step], temperature, with_entropy)
            logps.append(lp)
            entropies.append(ent)
        logp = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=torch.float32)  # (T,)
        entropy = torch.cat(entropies) if with_entropy and entropies else torch.zeros_like(logp)  # (T,)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, tokens, *params = ctx.saved_tensors
        device, enabled, dtype = ctx.autocast
        grad_hidden = torch.zeros_like(hidden)
        grad_params = [torch.zeros_like(p) for p in params]
        step = chunk_tokens(_vocab(ctx.head))
        for s in range(0, len(hidden), step):
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                h = hidden[s : s + step].detach().requires_grad_()
                lp, ent = _chunk(ctx.head, h, tokens[s : s + step], ctx.temperature, ctx.with_entropy and grad_entropy is not None)
                objective = (lp * grad_logp[s : s + step]).sum()
                if ent is not None:
                    objective = objective + (ent * grad_entropy[s : s + step]).sum()
                grads = torch.autograd.grad(objective, [h, *params], allow_unused=True)
            grad_hidden[s : s + step] = grads[0]
            for total, g in zip(grad_params, grads[1:]):
                if g is not None:
                    total += g
        return (grad_hidden, None, None, None, None, None, *grad_params)


def _vocab(head: nn.Module) -> int:
    return head.weight.shape[0]


def head_logprobs(head: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool = False, entropy_grad: bool = False):
    """Log-probs (T,) of `tokens` (T,) under softmax(head(hidden) / temperature), hidden (T, H),
    and the entropy (T,) of each distribution (zeros unless `with_entropy`; with gradient only if
    `entropy_grad`)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    params = [p for p in head.parameters() if p.requires_grad]
    return _ChunkedHead.apply(hidden, tokens, head, temperature, with_entropy, entropy_grad, *params)
