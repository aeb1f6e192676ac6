"""Clipped policy-gradient loss of GRPO and its variants, one normaliser per `loss_type`.

Every loss type shares the per-token objective (PPO clip, Schulman et al. 2017, eq. 7, with
GRPO's per-token KL penalty, Shao et al. 2024, eq. 3) and differs only in how the per-token
losses of a micro-batch are reduced to a scalar. The reductions follow TRL's GRPOTrainer so a
config moves over unchanged:

  grpo     mean over sequences of the per-sequence token mean          / grad_accum
  bnpo     token mean over the micro-batch                            / grad_accum
  dr_grpo  token sum / (sequences * max_completion_length)            / grad_accum
           (Dr. GRPO, arXiv:2503.20783, section 3.1: no length bias)
  dapo     token sum / tokens of the whole optimizer step on all ranks, times world_size
           because DDP averages gradients over ranks (DAPO, arXiv:2503.14476, section 3.3)
"""

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Normalisation:
    """Plain numbers a reduction may need, for one micro-batch."""

    max_completion_length: int
    grad_accum: int = 1  # micro-batches summed into one optimizer step
    step_tokens: float = 0.0  # completion tokens in the optimizer step, all ranks and micro-batches
    world_size: int = 1


Reduction = Callable[[torch.Tensor, torch.Tensor, Normalisation], torch.Tensor]
LOSS_TYPES: dict[str, Reduction] = {}


def register_loss(name: str) -> Callable[[Reduction], Reduction]:
    def add(fn: Reduction) -> Reduction:
        LOSS_TYPES[name] = fn
        return fn

    return add


def get_reduction(loss_type: str) -> Reduction:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid names: {', '.join(sorted(LOSS_TYPES))}")
    return LOSS_TYPES[loss_type]


@register_loss("grpo")
def _grpo(per_token: torch.Tensor, mask: torch.Tensor, norm: Normalisation) -> torch.Tensor:
    per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (N,)
    return per_seq.mean() / norm.grad_accum


@register_loss("bnpo")
def _bnpo(per_token: torch.Tensor, mask: torch.Tensor, norm: Normalisation) -> torch.Tensor:
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / norm.grad_accum


@register_loss("dr_grpo")
def _dr_grpo(per_token: torch.Tensor, mask: torch.Tensor, norm: Normalisation) -> torch.Tensor:
    return (per_token * mask).sum() / (per_token.shape[0] * norm.max_completion_length) / norm.grad_accum


@register_loss("dapo")
def _dapo(per_token: torch.Tensor, mask: torch.Tensor, norm: Normalisation) -> torch.Tensor:
    # A step with no loss tokens (every completion truncated and masked) has loss 0, not 0/0;
    # TRL clamps the count to at least 1 the same way.
    return (per_token * mask).sum() * norm.world_size / max(norm.step_tokens, 1.0)


IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str,
    norm: Normalisation,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of one micro-batch.

    logprobs (N, T): current policy, with gradient. old_logprobs (N, T): the policy the ratio is
    taken against (proximal), no gradient. advantages (N,). completion_mask (N, T) in {0, 1}.
    ref_logprobs (N, T): reference policy, needed when beta > 0.
    is_weights (N, T): off-policy importance weights (tandem.algo.importance), multiplying the
    policy-gradient term only, not the KL term (as TRL applies its vLLM correction).
    delta: upper clamp of the unclipped ratio, two-sided clipping (INTELLECT-2, arXiv:2505.07291).
    importance_sampling_level "sequence" uses one length-normalised ratio per sequence (GSPO,
    arXiv:2507.18071, eq. 7).
    Returns the scalar loss and detached metrics.
    """
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {importance_sampling_level!r}"
        )
    reduce = get_reduction(loss_type)
    mask = completion_mask.to(logprobs.dtype)  # (N, T)
    log_ratio = logprobs - old_logprobs  # (N, T)
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (N, 1)
    ratio = torch.exp(log_ratio)  # (N, T) or (N, 1)
    adv = advantages.unsqueeze(-1)  # (N, 1)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(unclipped * adv, clipped * adv)  # (N, T)
    per_token = per_token.expand_as(logprobs)
    if is_weights is not None:
        per_token = per_token * is_weights
    metrics: dict[str, torch.Tensor] = {}
    if beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("beta != 0 needs ref_logprobs")
        # k3 estimator of KL(current || ref), unbiased and always >= 0 (Schulman, "Approximating KL
        # divergence", 2020); GRPO eq. 4.
        diff = ref_logprobs - logprobs  # (N, T)
        per_token_kl = torch.exp(diff) - diff - 1  # (N, T)
        per_token = per_token + beta * per_token_kl
        metrics["kl"] = _masked_mean(per_token_kl, mask).detach()
    loss = reduce(per_token, mask, norm)
    return loss, metrics | _clip_ratios(ratio.expand_as(logprobs), adv, mask, epsilon_low, epsilon_high)


def _clip_ratios(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, epsilon_low: float, epsilon_high: float) -> dict[str, torch.Tensor]:
    """The share of tokens whose ratio (N, T) the clip holds at its low or high bound (where that
    bound binds: a negative or a positive advantage (N, 1)), as TRL reports them."""
    low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype)  # (N, T)
    high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)  # (N, T)
    return {
        "clip_ratio/low_mean": _masked_mean(low, mask).detach(),
        "clip_ratio/high_mean": _masked_mean(high, mask).detach(),
        "clip_ratio/region_mean": _masked_mean(low + high, mask).detach(),
    }
