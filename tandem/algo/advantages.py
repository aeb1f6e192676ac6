"""Group-relative advantages (GRPO, Shao et al. 2024, arXiv:2402.03300, section 4.1.2)."""

import torch

SCALE_REWARDS = ("group", "batch", "none")


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased standard deviation ignoring NaNs (torch.std semantics; NaN when fewer than 2 values).
    Summed in float64, returned in x's dtype: a float32 square overflows from |x| ~ 1e19 on."""
    dtype, x = x.dtype, x.double()
    valid = ~torch.isnan(x)
    count = valid.sum() if dim is None else valid.sum(dim)
    mean = torch.nanmean(x) if dim is None else torch.nanmean(x, dim=dim, keepdim=True)
    sq = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x))
    total = sq.sum() if dim is None else sq.sum(dim)
    return torch.sqrt(total / (count - 1).clamp(min=0)).to(dtype)  # 0/0: NaN below two values


def zero_std_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(B,) True for each group whose rewards all agree (or are too few to differ): its
    advantages are 0 and it teaches nothing. rewards: (B*G,), NaN for unknown."""
    return nanstd(rewards.view(-1, num_generations), dim=1).nan_to_num(0.0) < 1e-6


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", eps: float = 1e-4
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantage of each completion relative to the other completions of its prompt.

    rewards: (N,) with N = B*G, the G completions of a prompt contiguous; NaN marks a completion
    whose reward is unknown (every reward function returned None). NaN rewards are left out of
    the group statistics and get advantage 0, so they add nothing to the gradient.
    scale_rewards: "group" divides by the group's std, "batch" by the std over all N, "none" by
    nothing (Dr. GRPO, arXiv:2503.20783, section 3.1, argues the std division biases the update).
    Returns advantages (N,) in the rewards' dtype and detached statistics. They are computed in
    float64, so any finite float32 reward scale gives the same advantages (group and batch).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards must be (B*G,) with G={num_generations}, got shape {tuple(rewards.shape)}")
    grouped = rewards.double().view(-1, num_generations)  # (B, G)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)  # (B, 1)
    group_std = nanstd(grouped, dim=1)  # (B,)
    advantages = grouped - mean  # (B, G)
    if scale_rewards == "group":
        advantages = advantages / (group_std.nan_to_num(0.0).unsqueeze(1) + eps)
    elif scale_rewards == "batch":
        advantages = advantages / (nanstd(grouped).nan_to_num(0.0) + eps)
    advantages = advantages.nan_to_num(0.0).reshape(-1).to(rewards.dtype)  # (N,)
    stats = {
        "reward_std_in_group": torch.nanmean(group_std).to(rewards.dtype).detach(),
        "frac_groups_zero_std": zero_std_groups(rewards, num_generations).float().mean().detach(),
    }
    return advantages, stats
