"""Off-policy correction: importance weights from the behaviour policy (the engine that sampled)
to the proximal policy (the trainer's weights at the start of the round).

A rollout may come from other numerics than the trainer's forward (a rollout server, another
dtype or kernel) or, with asynchronous generation, from older weights. The PPO ratio stays
current/proximal (decoupled PPO, Hilton et al. 2022, arXiv:2110.00641, eq. 4; AReaL,
arXiv:2505.24298, section 5.2), and each token's policy-gradient term is multiplied by
w = proximal/behaviour, bounded to [clip_min, clip_max]: truncated importance sampling (Espeholt
et al. 2018, IMPALA, section 4) per token or per sequence, or masking of the tokens or sequences
whose weight falls outside the bounds (TRL's `vllm_importance_sampling_mode`).
"""

import math

import torch

OFF_POLICY_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(
    proximal_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_max: float | None,
    clip_min: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights (N, T), zero outside the mask, and detached metrics.

    proximal_logprobs, behav_logprobs, mask: (N, T). Sequence modes use the product of the
    sequence's token ratios, exp(sum of log ratios), one weight for all its tokens. The weights
    stay in log space until bounded: a product of 2000 ratios of 1.05 overflows float32, and an
    inf weight times a 0 mask is NaN.
    Metrics: `is_weight/*` are the weights applied (after truncation or masking), `is_log_ratio/*`
    the raw log ratio log(proximal/behaviour) before any bound (per sequence in sequence modes).
    """
    if mode not in OFF_POLICY_CORRECTIONS:
        raise ValueError(f"off_policy_correction must be one of {OFF_POLICY_CORRECTIONS}, got {mode!r}")
    mask = mask.to(proximal_logprobs.dtype)
    token_log_r = (proximal_logprobs - behav_logprobs) * mask  # (N, T)
    log_r = token_log_r
    if mode.startswith("sequence"):
        log_r = token_log_r.sum(-1, keepdim=True).expand_as(mask)  # (N, T), one value per sequence
    lo = -math.inf if not clip_min else math.log(clip_min)
    hi = math.inf if clip_max is None else math.log(clip_max)
    outside = ((log_r < lo) | (log_r > hi)) & (mask > 0)  # (N, T)
    if mode.endswith("truncate"):
        weights = torch.exp(log_r.clamp(min=lo, max=hi))
    elif mode.endswith("mask"):
        # a select, not a product: exp of an unbounded log ratio may be inf, and inf * 0 is NaN
        weights = torch.where(outside, torch.zeros_like(log_r), torch.exp(log_r.clamp(max=hi)))
    else:
        weights = torch.ones_like(log_r)
        outside = torch.zeros_like(outside)
    weights = weights * mask  # (N, T)
    n = mask.sum().clamp(min=1.0)
    valid = mask > 0
    # KL(behaviour || proximal) by the k3 estimator on behaviour samples: r - 1 - log r >= 0, per
    # token, in float64 so a single wild token cannot overflow it.
    d = token_log_r.double()
    kl = ((torch.exp(d) - 1 - d) * mask).sum() / n
    metrics = {
        "is_weight/mean": weights.sum() / n,
        "is_weight/min": _masked_extreme(weights, valid, torch.amin),
        "is_weight/max": _masked_extreme(weights, valid, torch.amax),
        "is_weight/frac_capped": outside.to(mask.dtype).sum() / n,
        "is_log_ratio/mean": (log_r * mask).sum() / n,
        "is_log_ratio/min": _masked_extreme(log_r, valid, torch.amin),
        "is_log_ratio/max": _masked_extreme(log_r, valid, torch.amax),
        "kl_behav_proximal": kl.to(proximal_logprobs.dtype),
    }
    return weights, {k: v.detach() for k, v in metrics.items()}


def _masked_extreme(x: torch.Tensor, valid: torch.Tensor, reduce) -> torch.Tensor:
    """min or max (torch.amin / torch.amax) over the masked-in entries; NaN when there are none."""
    fill = math.inf if reduce is torch.amin else -math.inf
    value = reduce(x.masked_fill(~valid, fill))
    return torch.where(valid.any(), value, torch.full_like(value, math.nan))
