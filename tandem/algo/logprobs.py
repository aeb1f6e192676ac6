"""Per-token log-probabilities and entropy from logits."""

import torch


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature; at temperature 1 the logits themselves, the same values without a
    pass over (N, V) of them (a decode step's 151,936-wide rows, the output layer's chunks)."""
    return logits if temperature == 1.0 else logits / temperature


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[..., index] without materialising the full (N, T, V) log-probs.

    logits: (N, T, V), index: (N, T) -> (N, T)
    """
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)  # (N, T)
        return picked - torch.logsumexp(logits, dim=-1)  # (N, T)
    # logsumexp in bf16/fp16 loses too much precision: go row by row in fp32.
    rows = [torch.log_softmax(row.float(), dim=-1) for row in logits]
    return torch.stack([torch.gather(lp, -1, idx.unsqueeze(-1)).squeeze(-1) for lp, idx in zip(rows, index)])


def selective_log_softmax_into(scores: torch.Tensor, index: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """The float32 path of selective_log_softmax, bitwise, for (N, V) `scores` and (N,) `index`:
    torch.logsumexp's ops written out, so that its (N, V) intermediate goes into `scratch` (N, V)
    instead of a tensor of its own (fresh pages to fault in, under the CLI's allocator settings)."""
    maxes = scores.amax(-1, keepdim=True)  # (N, 1)
    maxes.masked_fill_(maxes.abs() == torch.inf, 0)
    total = torch.sub(scores, maxes, out=scratch).exp_().sum(-1)  # (N,)
    return scores.gather(-1, index.unsqueeze(-1)).squeeze(-1) - total.log_().add_(maxes.squeeze(-1))  # (N,)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of `tokens` under softmax(logits / temperature), the distribution the sampler drew from.

    logits: (N, T, V), tokens: (N, T) -> (N, T)
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return selective_log_softmax(scaled(logits, temperature), tokens)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position. logits: (N, T, V) -> (N, T)"""
    logp = torch.log_softmax(scaled(logits.float(), temperature), dim=-1)  # (N, T, V)
    return -(logp.exp() * logp).sum(-1)  # (N, T)
