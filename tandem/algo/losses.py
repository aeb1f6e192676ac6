"""The policy-gradient loss of GRPO and its variants, as TRL 1.16's GRPOTrainer defines them, so
a config moves over unchanged. A loss type is a per-token objective and a reduction:

  objective  clip   PPO's clipped ratio (Schulman et al. 2017, eq. 7), with two-sided clipping
                    by delta (INTELLECT-2, arXiv:2505.07291)
             cispo  the ratio clamped at epsilon_high and detached, times A log pi: every token
                    keeps a gradient (MiniMax-M1, arXiv:2506.13585, section 3.1)
             sapo   a sigmoid gate 4 sigma(tau (r - 1)) / tau instead of the hard clip, tau by
                    the advantage's sign (SAPO, arXiv:2511.20347)
             vespo  a gamma weight phi(w) = e^lambda w^k e^(-lambda w) of the sequence's ratio w,
                    detached, times A log pi (VESPO, arXiv:2602.10693)
  reduction  grpo     mean over sequences of the per-sequence token mean          / grad_accum
             bnpo     token mean over the micro-batch                            / grad_accum
             dr_grpo  token sum / (sequences * max_completion_length)            / grad_accum
                      (Dr. GRPO, arXiv:2503.20783, section 3.1: no length bias)
             dapo     token sum / tokens of the whole optimizer step on all ranks, times
                      world_size because DDP averages gradients over ranks (DAPO, 3.3)
             luspo    mean over sequences of the per-sequence token sum          / grad_accum
                      (LUSPO: each sequence weighs by its length)

  grpo bnpo dr_grpo dapo luspo: clip;  cispo: cispo + dapo;  sapo: sapo + grpo;  vespo: vespo + dapo

A sequence of the reductions may span rows: an agent's trajectory whose history was rewritten is
several rows (Rollout.rows), reduced as the one sequence they make, so that a trajectory weighs
the same however its framework rendered it. The ratios of importance_sampling_level 'sequence'
and vespo's weight are per row.

GRPO's per-token KL penalty (Shao et al. 2024, eq. 3, k3 estimator) is added to every objective;
with kl_bias_correction (TRL's use_bias_correction_kl, on by default there) it is weighted by the
ratio current/proximal, which carries gradient.
"""

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch


@dataclass(frozen=True)
class Normalisation:
    """Plain numbers a reduction may need, for one micro-batch."""

    max_completion_length: int
    grad_accum: int = 1  # micro-batches summed into one optimizer step
    step_tokens: float = 0.0  # dapo's divisor: the step's loss tokens, all ranks and micro-batches (step_token_normalizers)
    world_size: int = 1
    sequences: int = 0  # of the micro-batch, a sequence possibly several rows (policy_loss counts them)


@dataclass(frozen=True)
class Objective:
    """Plain numbers the per-token objectives take (TRL's names and defaults)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


# (per_token (N, T), mask (N, T), norm, sequences (N,): the sequence 0..norm.sequences-1 each row belongs to) -> the loss
Reduction = Callable[[torch.Tensor, torch.Tensor, Normalisation, torch.Tensor], torch.Tensor]
ObjectiveFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
REDUCTIONS: dict[str, Reduction] = {}
OBJECTIVES: dict[str, ObjectiveFn] = {}
LOSS_TYPES: dict[str, tuple[str, str]] = {}  # loss_type -> (objective, reduction)


def register_reduction(name: str) -> Callable[[Reduction], Reduction]:
    def add(fn: Reduction) -> Reduction:
        REDUCTIONS[name] = fn
        return fn

    return add


def register_objective(name: str) -> Callable[[ObjectiveFn], ObjectiveFn]:
    def add(fn: ObjectiveFn) -> ObjectiveFn:
        OBJECTIVES[name] = fn
        return fn

    return add


def register_loss(name: str, objective: str, reduction: str) -> None:
    LOSS_TYPES[name] = (objective, reduction)


def get_loss_type(loss_type: str) -> tuple[ObjectiveFn, Reduction]:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid names: {', '.join(sorted(LOSS_TYPES))}")
    objective, reduction = LOSS_TYPES[loss_type]
    return OBJECTIVES[objective], REDUCTIONS[reduction]


def get_reduction(loss_type: str) -> Reduction:
    return get_loss_type(loss_type)[1]


def _per_sequence(per_row: torch.Tensor, sequences: torch.Tensor, norm: Normalisation) -> torch.Tensor:
    """(N,) values of rows -> (S,) their sums per sequence (differentiable)."""
    return per_row.new_zeros(norm.sequences).index_add(0, sequences, per_row)


@register_reduction("grpo")
def _grpo(per_token: torch.Tensor, mask: torch.Tensor, norm: Normalisation, sequences: torch.Tensor) -> torch.Tensor:
    per_seq = _per_sequence((per_token * mask).sum(-1), sequences, norm) / _per_sequence(mask.sum(-1), sequences, norm).clamp(min=1.0)  # (S,)
    return per_seq.mean() / norm.grad_accum


@register_reduction("bnpo")
def _bnpo(per_token: torch.Tensor, mask: torch.Tensor, norm: Normalisation, sequences: torch.Tensor) -> torch.Tensor:
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / norm.grad_accum


@register_reduction("dr_grpo")
def _dr_grpo(per_token: torch.Tensor, mask: torch.Tensor, norm: Normalisation, sequences: torch.Tensor) -> torch.Tensor:
    return (per_token * mask).sum() / (norm.sequences * norm.max_completion_length) / norm.grad_accum


@register_reduction("dapo")
def _dapo(per_token: torch.Tensor, mask: torch.Tensor, norm: Normalisation, sequences: torch.Tensor) -> torch.Tensor:
    # A step with no loss tokens (every completion truncated and masked) has loss 0, not 0/0;
    # TRL clamps the count to at least 1 the same way.
    return (per_token * mask).sum() * norm.world_size / max(norm.step_tokens, 1.0)


# What dapo's reduction (dapo, cispo, vespo) divides each optimizer step's token sum by, from the
# loss-token counts (num_iterations, steps_per_pass) of a round's steps over every rank:
#   step        each step's own count: the token mean of the batch the step trains (DAPO, eq. 12)
#   round_mean  the round's count / steps per pass, alike for every step of the pass (TRL 1.16's:
#               it divides by the generation batch's tokens x GA / steps_per_generation). The
#               two differ only when a round is several optimizer steps.
TOKEN_NORMALIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "step": lambda counts: counts,
    "round_mean": lambda counts: counts.sum(-1, keepdim=True).expand_as(counts) / counts.shape[-1],
}


def step_token_normalizers(counts: torch.Tensor, how: str) -> torch.Tensor:
    """(num_iterations, steps_per_pass) loss-token counts -> what each step's dapo reduction divides by."""
    if how not in TOKEN_NORMALIZERS:
        raise ValueError(f"unknown token_normalizer {how!r}; valid names: {', '.join(TOKEN_NORMALIZERS)}")
    return TOKEN_NORMALIZERS[how](counts)


@register_reduction("luspo")
def _luspo(per_token: torch.Tensor, mask: torch.Tensor, norm: Normalisation, sequences: torch.Tensor) -> torch.Tensor:
    return _per_sequence((per_token * mask).sum(-1), sequences, norm).mean() / norm.grad_accum


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
    kl_bias_correction: bool = False,
    keep: torch.Tensor | None = None,
    objective: Objective | None = None,
    sequences: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of one micro-batch.

    logprobs (N, T): current policy, with gradient. old_logprobs (N, T): the policy the ratio is
    taken against (proximal), no gradient. advantages (N,). completion_mask (N, T) in {0, 1}.
    ref_logprobs (N, T): reference policy, needed when beta > 0.
    is_weights (N, T): off-policy importance weights (tandem.algo.importance), multiplying the
    policy-gradient term only, not the KL term (as TRL applies its vLLM correction); vespo folds
    them into its sequence ratio instead.
    keep (N, T) or (N, 1) in {0, 1}: tokens or sequences whose policy-gradient term counts
    (off_policy_sequence_mask, high_entropy_mask); the KL term and the reduction's counts are kept.
    importance_sampling_level "sequence" uses one length-normalised ratio per sequence (GSPO,
    arXiv:2507.18071, eq. 7). `objective` holds the objectives' numbers beyond the clip's
    (epsilon_low, epsilon_high and delta, given apart, win over its own). sequences (N,): the
    sequence of the reduction each row belongs to (an agent's rows share one); None: a row each.
    Returns the scalar loss and detached metrics.
    """
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {importance_sampling_level!r}"
        )
    objective_fn, reduce = get_loss_type(loss_type)
    opts = replace(objective or Objective(), epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta)
    mask = completion_mask.to(logprobs.dtype)  # (N, T)
    token_log_ratio = logprobs - old_logprobs  # (N, T)
    log_ratio = token_log_ratio
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (N, 1)
    ratio = torch.exp(log_ratio)  # (N, T) or (N, 1)
    adv = advantages.unsqueeze(-1)  # (N, 1)
    per_token, metrics = objective_fn(
        logprobs=logprobs, ratio=ratio, token_log_ratio=token_log_ratio, adv=adv, mask=mask, is_weights=is_weights, opts=opts
    )
    per_token = per_token.expand_as(logprobs)  # (N, T)
    if keep is not None:
        per_token = per_token * keep
    if is_weights is not None and objective_fn is not _vespo:
        per_token = per_token * is_weights
    if beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("beta != 0 needs ref_logprobs")
        # k3 estimator of KL(current || ref), unbiased and always >= 0 (Schulman, "Approximating KL
        # divergence", 2020); GRPO eq. 4.
        diff = ref_logprobs - logprobs  # (N, T)
        per_token_kl = torch.exp(diff) - diff - 1  # (N, T)
        if kl_bias_correction:  # the KL of samples from the proximal policy, weighted to the current one
            per_token_kl = per_token_kl * ratio
        per_token = per_token + beta * per_token_kl
        metrics = {"kl": _masked_mean(per_token_kl, mask).detach(), **metrics}
    if sequences is None:
        sequences = torch.arange(logprobs.shape[0])
    norm = replace(norm, sequences=int(sequences.max()) + 1 if len(sequences) else 0)  # counted where they are (the CPU): no wait on the device
    return reduce(per_token, mask, norm, sequences.to(logprobs.device)), metrics


@register_objective("clip")
def _clip(*, ratio, adv, mask, opts: Objective, **_) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A), r capped at delta when given."""
    unclipped = ratio if opts.delta is None else torch.clamp(ratio, max=opts.delta)
    clipped = torch.clamp(ratio, 1 - opts.epsilon_low, 1 + opts.epsilon_high)
    per_token = -torch.min(unclipped * adv, clipped * adv)  # (N, T) or (N, 1)
    return per_token, _clip_ratios(ratio, adv, mask, opts.epsilon_low, opts.epsilon_high)


@register_objective("cispo")
def _cispo(*, logprobs, ratio, adv, mask, opts: Objective, **_) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-sg(min(r, epsilon_high)) A log pi: the clamp bounds the weight, not the gradient's reach
    (TRL's cispo: epsilon_high is the weight's upper bound itself, e.g. 5, not 1 + epsilon_high)."""
    weight = torch.clamp(ratio, max=opts.epsilon_high).detach()
    clipped = ((ratio > opts.epsilon_high) & (adv > 0)).to(mask.dtype)  # (N, T) or (N, 1)
    return -weight * adv * logprobs, {"cispo_clip_ratio": _share(clipped, mask).detach()}


@register_objective("sapo")
def _sapo(*, ratio, adv, opts: Objective, **_) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-(4 / tau) sigmoid(tau (r - 1)) A, tau = sapo_temperature_pos for A > 0, else _neg: equal to
    -r A near r = 1 (its gradient there is A), a soft, smooth clip away from it."""
    tau = torch.where(adv > 0, opts.sapo_temperature_pos, opts.sapo_temperature_neg)  # (N, 1)
    return -(torch.sigmoid(tau * (ratio - 1)) * 4 / tau) * adv, {}


@register_objective("vespo")
def _vespo(*, logprobs, token_log_ratio, adv, mask, is_weights, opts: Objective, **_) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-sg(phi(w)) A log pi with w the sequence's whole ratio, the product of its tokens' ratios
    (current/proximal, times the off-policy weights when given), and phi(w) = e^lambda w^k
    e^(-lambda w), so phi(1) = 1; k and lambda by the advantage's sign. In log space with TRL's
    bounds: token log ratios in [-20, 20], log w and the weights' logs in [log 1e-8, 20]."""
    with torch.no_grad():
        floor = math.log(1e-8)
        log_w = (torch.clamp(token_log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)  # (N, 1)
        if is_weights is not None:
            log_w = log_w + (torch.clamp(torch.log(is_weights), floor, 20.0) * mask).sum(-1, keepdim=True)  # padding's weight is 0
        log_w = torch.clamp(log_w, floor, 20.0)
        positive = adv >= 0
        k = torch.where(positive, opts.vespo_k_pos, opts.vespo_k_neg)
        lam = torch.where(positive, opts.vespo_lambda_pos, opts.vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # (N, 1)
    return -phi * adv * logprobs, {"vespo/phi_seq_mean": phi.mean()}


def _share(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The share of flagged tokens (N, T), or with one flag a sequence (N, 1), of the sequences
    (importance_sampling_level sequence): TRL 1.16's metrics, in its code and docs. A sequence
    without a loss token (truncated and masked) counts in neither; TRL's code counts it unflagged."""
    if flags.shape[-1] != 1:
        return _masked_mean(flags, mask)
    trained = (mask.sum(-1, keepdim=True) > 0).to(mask.dtype)  # (N, 1)
    return (flags * trained).sum() / trained.sum().clamp(min=1.0)


def _clip_ratios(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, epsilon_low: float, epsilon_high: float) -> dict[str, torch.Tensor]:
    """The share of tokens, or of sequences (a ratio (N, 1)), whose ratio (N, T) the clip holds at
    its low or high bound (where that bound binds: a negative or a positive advantage (N, 1)), as
    TRL reports them."""
    low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype)  # (N, T) or (N, 1)
    high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)  # (N, T) or (N, 1)
    return {
        "clip_ratio/low_mean": _share(low, mask).detach(),
        "clip_ratio/high_mean": _share(high, mask).detach(),
        "clip_ratio/region_mean": _share(low + high, mask).detach(),
    }


for _name in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
    register_loss(_name, "clip", _name)
register_loss("cispo", "cispo", "dapo")
register_loss("sapo", "sapo", "grpo")
register_loss("vespo", "vespo", "dapo")


def off_policy_sequence_mask(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                             threshold: float) -> torch.Tensor:  # fmt: skip
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv:2512.02556, section 3.1; TRL's
    off_policy_mask_threshold): a sequence with a negative advantage whose mean per-token
    KL(sampling || current), estimated as log pi_sampling - log pi_current on its own tokens, exceeds
    `threshold` is dropped from the policy gradient. logprobs, sampling_logprobs, mask (N, T),
    advantages (N,) -> (N, 1) in {0, 1}. Tokens the sampler could not score (NaN) count as 0."""
    kl = torch.nan_to_num(sampling_logprobs - logprobs.detach(), nan=0.0)  # (N, T)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # (N, 1)
    return ((advantages.unsqueeze(-1) >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """Tokens whose entropy is at least `threshold` (N, T) in {0, 1}: with the threshold at the
    1 - top_entropy_quantile quantile of the step's tokens, the policy gradient of the top
    quantile's tokens only (Wang et al. 2025, "Beyond the 80/20 rule", arXiv:2506.01939)."""
    return ((entropy * mask >= threshold) & (mask > 0)).to(mask.dtype)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, coef: float, grad_accum: int) -> torch.Tensor:
    """-coef times the mean entropy (N, T), with gradient, of the tokens in `mask`, one micro-batch's
    share of the step: added to the loss, it rewards exploration (TRL's entropy_coef)."""
    return -coef * (entropy * mask).sum() / mask.sum().clamp(min=1.0) / grad_accum


def next_entropy_coef(coef: float, world_entropy: float, target: float, delta: float, lowest: float, highest: float) -> float:
    """The adaptive entropy coefficient after a step: up by delta while the step's mean entropy
    over every rank is at or below target, down by delta above it, within [lowest, highest]
    (TRL's use_adaptive_entropy; the coefficient applies only while the entropy is at or below
    target)."""
    if world_entropy <= target:
        return min(coef + delta, highest)
    return max(coef - delta, lowest)
