"""Off-policy correction: importance weights from the behaviour policy (the engine that sampled)
to the proximal policy (the trainer's weights at the start of the round).

With asynchronous generation a rollout may come from older weights than the ones the round's
update starts from. The PPO ratio stays current/proximal (decoupled PPO, Hilton et al. 2022,
arXiv:2110.00641, eq. 4; AReaL, arXiv:2505.24298, section 5.2), and each token's policy-gradient
term is multiplied by w = proximal/behaviour, capped: truncated importance sampling (Espeholt et
al. 2018, IMPALA, section 4) per token or per sequence, or masking of the tokens or sequences
whose weight exceeds the cap.
"""

import torch

OFF_POLICY_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(
    proximal_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights (N, T) and detached metrics.

    proximal_logprobs, behav_logprobs, mask: (N, T). Sequence modes use the product of the
    sequence's token ratios, exp(sum of log ratios), one weight for all its tokens.
    """
    if mode not in OFF_POLICY_CORRECTIONS:
        raise ValueError(f"off_policy_correction must be one of {OFF_POLICY_CORRECTIONS}, got {mode!r}")
    mask = mask.to(proximal_logprobs.dtype)
    log_w = (proximal_logprobs - behav_logprobs) * mask  # (N, T)
    if mode.startswith("sequence"):
        log_w = log_w.sum(-1, keepdim=True).expand_as(mask)  # (N, T), one value per sequence
    w = torch.exp(log_w)  # (N, T)
    over = (w > cap).to(mask.dtype) * mask  # (N, T)
    if mode.endswith("truncate"):
        weights = torch.clamp(w, max=cap)
    elif mode.endswith("mask"):
        weights = w * (1 - over)
    else:
        weights = torch.ones_like(w)
    n = mask.sum().clamp(min=1.0)
    raw = w.masked_fill(mask == 0, float("nan"))
    token_w = torch.exp(proximal_logprobs - behav_logprobs)  # (N, T), r = proximal / behaviour
    # KL(behaviour || proximal) by the k3 estimator on behaviour samples: r - 1 - log r >= 0
    kl = ((token_w - 1 - (proximal_logprobs - behav_logprobs)) * mask).sum() / n
    metrics = {
        "is_weight/mean": (w * mask).sum() / n,
        "is_weight/min": torch.nan_to_num(raw, nan=float("inf")).min(),
        "is_weight/max": torch.nan_to_num(raw, nan=float("-inf")).max(),
        "is_weight/frac_capped": over.sum() / n,
        "kl_behav_proximal": kl,
    }
    return weights * mask, {k: v.detach() for k, v in metrics.items()}
