"""The learner: the policy being trained, its optimizer and schedule, its reference, and the two
things done with them: log-probs without gradient, and the micro-steps and optimizer step of the
update. What the run's mode and sharding decide (DDP's or FSDP's gradient-sync switch, lockstep
micro-batches, LoRA's reference) is resolved when it is built; its methods branch on none of it."""

import math
from dataclasses import dataclass
from typing import Callable

import torch

from tandem.algo import (
    Normalisation,
    Objective,
    entropy_bonus,
    high_entropy_mask,
    importance_weights,
    next_entropy_coef,
    off_policy_sequence_mask,
    policy_loss,
)
from tandem.engines.engine import eval_mode
from tandem.rollout.types import Rollout
from tandem.trainer import sharding
from tandem.trainer.batch import MAX_BUCKETS, collate, completion_logprobs
from tandem.trainer.dist import Dist


class NonFiniteStepError(RuntimeError):
    """A step's loss or gradient norm was NaN or inf and on_nonfinite is 'error'."""


@dataclass(frozen=True)
class LossSettings:
    """The loss and its corrections, as plain values (TrainConfig's names)."""

    loss_type: str
    objective: Objective  # epsilons, delta, sapo's and vespo's numbers
    importance_sampling_level: str
    beta: float
    kl_bias_correction: bool  # use_bias_correction_kl
    temperature: float
    mask_truncated_completions: bool
    off_policy_correction: str
    importance_sampling_cap: float
    importance_sampling_clip_min: float | None
    off_policy_mask_threshold: float | None
    top_entropy_quantile: float


@dataclass
class EntropyBonus:
    """The entropy bonus and its adaptive coefficient (TRL's entropy_coef, use_adaptive_entropy):
    state that a checkpoint keeps (coef, last_entropy)."""

    coef: float
    adaptive: bool = False
    lowest: float = 0.0
    highest: float = 1.0
    delta: float = 0.005
    target: float = 0.2
    last_entropy: float = math.inf  # the mean entropy of the last step over every rank (none yet: inf)

    @property
    def on(self) -> bool:
        return self.coef != 0.0 or self.adaptive

    def applied(self) -> float:
        """The coefficient of this step: the adaptive one acts only while entropy is at or below target."""
        return self.coef if not self.adaptive or self.last_entropy <= self.target else 0.0

    def state_dict(self) -> dict:
        return {"entropy_coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last_entropy = state["entropy_coef"], state["last_entropy"]


@dataclass(frozen=True)
class ReferenceSync:
    """TR-DPO's moving reference (TRL's sync_ref_model): every `every` steps, ref = alpha * policy
    + (1 - alpha) * ref. `every` 0: the reference stays."""

    alpha: float = 0.6
    every: int = 0


class Learner:
    def __init__(self, model, optimizer, scheduler, ref_model, dist: Dist, pad_id: int, loss: LossSettings, micro_batch: int,
                 max_grad_norm: float, on_nonfinite: str, lockstep: bool, grad_sync: Callable[[bool], None],
                 entropy: EntropyBonus, ref_sync: ReferenceSync):  # fmt: skip
        """`model` is the prepared PrefixSharingLM (under DDP when several processes train whole
        copies); `ref_model` the frozen reference, or None (no KL term, or LoRA, whose reference
        is the policy with its adapters disabled); `lockstep`: sharded, every forward a collective;
        `grad_sync(on)`: whether the next backward all-reduces (DDP) or reduce-scatters (FSDP)."""
        self.model, self.optimizer, self.scheduler, self.ref_model = model, optimizer, scheduler, ref_model
        self.dist, self.pad_id, self.loss, self.micro_batch = dist, pad_id, loss, micro_batch
        self.max_grad_norm, self.on_nonfinite, self.lockstep, self.grad_sync = max_grad_norm, on_nonfinite, lockstep, grad_sync
        self.entropy, self.ref_sync = entropy, ref_sync
        self._entropy_window = torch.zeros(2)  # the step's entropy sum and token count so far (adaptive bonus)

    @property
    def lm(self) -> torch.nn.Module:
        """The causal LM being trained, outside DDP and the prefix-sharing wrapper."""
        return self.dist.accelerator.unwrap_model(self.model).lm

    # ------------------------------------------------------------------ log-probs without gradient

    def proximal_logprobs(self, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """Log-probs of the rollouts' rows (Rollout.rows, in order) under the policy."""
        return self._logprobs_no_grad(self.model, rollouts)

    def reference_logprobs(self, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """Of the rows, under the reference model: with LoRA, the policy with its adapters disabled."""
        if self.ref_model is not None:
            return self._logprobs_no_grad(self.ref_model, rollouts)
        with self.lm.disable_adapter():
            return self._logprobs_no_grad(self.model, rollouts)

    @torch.no_grad()
    def _logprobs_no_grad(self, model, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """Log-probs without gradient (proximal or reference policy), under the training forward's
        autocast: the reference model is not prepared by accelerate, and a reference in fp32
        against a bf16 policy would make KL(current || ref) non-zero at step 0. In eval mode, as
        TRL computes them: no dropout in the policies the ratio and the KL compare with. A chunk
        is micro_batch rollouts with their rows, so that every rank makes as many calls."""
        out = []
        for lo in range(0, len(rollouts), self.micro_batch):
            sequences = rollouts[lo : lo + self.micro_batch]
            chunk = [row for r in sequences for row in r.rows()]
            mb = collate(chunk, self.pad_id, self.dist.device, False, self._buckets(len(sequences)), lockstep=self.lockstep)
            if self.lockstep:
                self.dist.enter("forward (sharded, no gradient)")
            with eval_mode(model), self.dist.accelerator.autocast():
                logps, _ = completion_logprobs(model, mb, self.loss.temperature)  # (n, C)
            out += [logps[i, : len(r.completion_ids)].cpu() for i, r in enumerate(chunk)]
        return out

    def _buckets(self, sequences: int) -> int:
        """Most buckets of a micro-batch of `sequences` sequences: in lockstep, what every rank can
        make alike (a sequence may be several rows, more on one rank than another)."""
        return min(MAX_BUCKETS, sequences) if self.lockstep else MAX_BUCKETS

    # ------------------------------------------------------------------ the update

    def micro_step_collective(self, train_rows, idx, sequences, advantages, old_logps, ref_logps, behav_logps, norm: Normalisation, sync: bool):
        """Forward and backward of one micro-batch, the rows `idx` of `train_rows` (N_rows,), each of the
        sequence `sequences` (n,) of the reduction; `advantages` and the log-probs are per row.
        Gradients are synced on the last micro-batch only (then the backward is a collective)."""
        cfg, obj = self.loss, self.loss.objective
        mb = collate([train_rows[i] for i in idx], self.pad_id, self.dist.device, cfg.mask_truncated_completions, self._buckets(int(sequences.max()) + 1),
                     lockstep=self.lockstep)  # fmt: skip
        C, mask = mb.completion_ids.shape[1], mb.completion_mask
        self.grad_sync(sync)
        if self.lockstep:
            self.dist.enter("forward (sharded)")
        logps, entropy = completion_logprobs(self.model, mb, cfg.temperature, with_entropy=True, entropy_grad=self.entropy.on)  # (n, C)
        rows = lambda t: t[idx, :C].to(logps.device) if t is not None else None  # noqa: E731 - (N_rank, C') -> (n, C)
        old, adv = rows(old_logps) if old_logps is not None else logps.detach(), advantages[idx].to(logps.device)
        is_weights, is_metrics = None, {}
        if behav_logps is not None:
            is_weights, is_metrics = importance_weights(
                old, rows(behav_logps), mask, cfg.off_policy_correction, clip_max=cfg.importance_sampling_cap, clip_min=cfg.importance_sampling_clip_min
            )  # fmt: skip
        keep, trained = self._kept_collective(logps, old if behav_logps is None else rows(behav_logps), entropy.detach(), adv, mask)
        loss, stats = policy_loss(
            logps, old, adv, mask, loss_type=cfg.loss_type, norm=norm, epsilon_low=obj.epsilon_low, epsilon_high=obj.epsilon_high,
            delta=obj.delta, importance_sampling_level=cfg.importance_sampling_level, beta=cfg.beta, ref_logprobs=rows(ref_logps),
            is_weights=is_weights, kl_bias_correction=cfg.kl_bias_correction, keep=keep, objective=obj, sequences=sequences,
        )  # fmt: skip
        stats.update(is_metrics)
        if keep is not None:  # the share of the loss tokens whose policy gradient counts
            stats["policy_gradient/kept_tokens"] = (keep.expand_as(mask) * mask).sum() / mask.sum().clamp(min=1.0)
        if self.entropy.on:  # over the tokens the policy gradient trains
            coef = self.entropy.applied()
            loss = loss + entropy_bonus(entropy, trained, coef, norm.grad_accum)
            self._entropy_window += torch.stack([(entropy.detach() * trained).sum(), trained.sum()]).cpu()
            stats["entropy_coef"] = torch.tensor(coef)
        if sync and (self.dist.world > 1 or self.lockstep):
            self.dist.enter("backward (gradients synced)")
        self.dist.accelerator.backward(loss)
        stats["entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1.0)
        return loss.detach(), stats

    def _kept_collective(self, logps, sampling_logps, entropy, adv, mask) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Which sequences and tokens the policy gradient trains, (n, 1) or (n, C) or None for all,
        and the token mask (n, C) that leaves: off_policy_mask_threshold drops drifted sequences
        with a negative advantage; top_entropy_quantile keeps the tokens above the quantile of the
        micro-batch's entropies over every rank (a collective, as TRL's gather)."""
        keep = None
        if self.loss.off_policy_mask_threshold is not None:
            keep = off_policy_sequence_mask(logps, sampling_logps, adv, mask, self.loss.off_policy_mask_threshold)
        trained = mask
        if self.loss.top_entropy_quantile < 1.0:
            values = entropy[mask > 0].float().cpu()  # this rank's tokens
            counts = self.dist.gather_collective(torch.tensor([len(values)]), "entropy counts")
            padded = torch.full((int(counts.max()),), math.nan)
            padded[: len(values)] = values
            every = self.dist.gather_collective(padded, "entropies")
            every = every[~torch.isnan(every)]
            threshold = torch.quantile(every, 1 - self.loss.top_entropy_quantile).item() if len(every) else math.inf
            hot = high_entropy_mask(entropy, mask, threshold)  # (n, C)
            keep = hot if keep is None else keep * hot
            trained = mask * hot
        return keep, trained

    def optimizer_step_collective(self, loss: torch.Tensor, step: int) -> tuple[torch.Tensor, bool]:
        """Clip and step (the gradient norm and the decision are collectives); returns the norm
        and whether the step was skipped. A step whose loss or gradient norm is NaN or inf on any
        rank never updates the weights: it is skipped or raised, per on_nonfinite. The scheduler
        moves on either way, so the learning rate stays a function of the step."""
        params = self.model.parameters()
        self.dist.enter("gradient norm")
        if self.max_grad_norm > 0:
            grad_norm = self.dist.accelerator.clip_grad_norm_(params, self.max_grad_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        grad_norm = sharding.full_value(grad_norm)  # sharded gradients have a sharded norm
        bad = (~torch.isfinite(loss.float()) | ~torch.isfinite(grad_norm.float())).float()
        # The losses differ between ranks: decide together, or one rank would step alone.
        bad = self.dist.sum_collective(bad, "non-finite steps")
        skipped = bad.item() > 0
        if skipped and self.on_nonfinite == "error":
            raise NonFiniteStepError(
                f"step {step}: loss {loss.item():.4g}, gradient norm {grad_norm.item():.4g} on this process, not finite on at "
                "least one process; the weights were not updated. Check the reward scale and learning_rate, or set "
                "on_nonfinite: skip to skip such steps"
            )
        if not skipped:
            self.optimizer.step()
        self.step_lr = self.scheduler.get_last_lr()[0]  # the step's, which its metrics line logs (TRL's curve)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.entropy.adaptive:  # the step's entropy over every rank sets the next step's coefficient
            total = self.dist.sum_collective(self._entropy_window, "entropy of the step")
            self.entropy.last_entropy = (total[0] / total[1].clamp(min=1.0)).item()
            lo, hi, e = self.entropy.lowest, self.entropy.highest, self.entropy
            self.entropy.coef = next_entropy_coef(e.coef, e.last_entropy, e.target, e.delta, lo, hi)
        self._entropy_window = torch.zeros(2)
        if self.ref_sync.every and step % self.ref_sync.every == 0:
            self._move_reference()
        return grad_norm, skipped

    @torch.no_grad()
    def _move_reference(self) -> None:
        """ref = alpha * policy + (1 - alpha) * ref, weight by weight (sharded: shard by shard, as both
        models are sharded alike)."""
        alpha = self.ref_sync.alpha
        for ref, p in zip(self.ref_model.lm.parameters(), self.lm.parameters()):
            ref.mul_(1 - alpha).add_(p.detach().to(ref.dtype), alpha=alpha)
