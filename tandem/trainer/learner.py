"""The learner: the policy being trained, its optimizer and schedule, its reference, and the two
things done with them: log-probs without gradient, and the micro-steps and optimizer step of the
update. What the run's mode and sharding decide (DDP's or FSDP's gradient-sync switch, lockstep
micro-batches, LoRA's reference) is resolved when it is built; its methods branch on none of it."""

from dataclasses import dataclass
from typing import Callable

import torch

from tandem.algo import Normalisation, importance_weights, policy_loss
from tandem.rollout.types import Rollout
from tandem.trainer import sharding
from tandem.trainer.batch import collate, completion_logprobs
from tandem.trainer.dist import Dist


class NonFiniteStepError(RuntimeError):
    """A step's loss or gradient norm was NaN or inf and on_nonfinite is 'error'."""


@dataclass(frozen=True)
class LossSettings:
    """The loss and its corrections, as plain values (TrainConfig's names)."""

    loss_type: str
    epsilon: float
    epsilon_high: float
    delta: float | None
    importance_sampling_level: str
    beta: float
    temperature: float
    mask_truncated_completions: bool
    off_policy_correction: str
    importance_sampling_cap: float
    importance_sampling_clip_min: float | None


class Learner:
    def __init__(self, model, optimizer, scheduler, ref_model, dist: Dist, pad_id: int, loss: LossSettings, micro_batch: int,
                 max_grad_norm: float, on_nonfinite: str, lockstep: bool, grad_sync: Callable[[bool], None]):  # fmt: skip
        """`model` is the prepared PrefixSharingLM (under DDP when several processes train whole
        copies); `ref_model` the frozen reference, or None (no KL term, or LoRA, whose reference
        is the policy with its adapters disabled); `lockstep`: sharded, every forward a collective;
        `grad_sync(on)`: whether the next backward all-reduces (DDP) or reduce-scatters (FSDP)."""
        self.model, self.optimizer, self.scheduler, self.ref_model = model, optimizer, scheduler, ref_model
        self.dist, self.pad_id, self.loss, self.micro_batch = dist, pad_id, loss, micro_batch
        self.max_grad_norm, self.on_nonfinite, self.lockstep, self.grad_sync = max_grad_norm, on_nonfinite, lockstep, grad_sync

    @property
    def lm(self) -> torch.nn.Module:
        """The causal LM being trained, outside DDP and the prefix-sharing wrapper."""
        return self.dist.accelerator.unwrap_model(self.model).lm

    # ------------------------------------------------------------------ log-probs without gradient

    def proximal_logprobs(self, rollouts: list[Rollout]) -> list[torch.Tensor]:
        return self._logprobs_no_grad(self.model, rollouts)

    def reference_logprobs(self, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """Log-probs of the reference model: with LoRA, the policy with its adapters disabled."""
        if self.ref_model is not None:
            return self._logprobs_no_grad(self.ref_model, rollouts)
        with self.lm.disable_adapter():
            return self._logprobs_no_grad(self.model, rollouts)

    @torch.no_grad()
    def _logprobs_no_grad(self, model, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """Log-probs without gradient (proximal or reference policy), under the training forward's
        autocast: the reference model is not prepared by accelerate, and a reference in fp32
        against a bf16 policy would make KL(current || ref) non-zero at step 0."""
        out = []
        for lo in range(0, len(rollouts), self.micro_batch):
            chunk = rollouts[lo : lo + self.micro_batch]
            mb = collate(chunk, self.pad_id, self.dist.device, False, lockstep=self.lockstep)
            if self.lockstep:
                self.dist.enter("forward (sharded, no gradient)")
            with self.dist.accelerator.autocast():
                logps, _ = completion_logprobs(model, mb, self.loss.temperature)  # (n, C)
            out += [logps[i, : len(r.completion_ids)].cpu() for i, r in enumerate(chunk)]
        return out

    # ------------------------------------------------------------------ the update

    def micro_step(self, rollouts, idx, advantages, old_logps, ref_logps, behav_logps, norm: Normalisation, sync: bool):
        """Forward and backward of one micro-batch; gradients are synced on the last one only
        (then the backward is a collective)."""
        cfg = self.loss
        mb = collate([rollouts[i] for i in idx], self.pad_id, self.dist.device, cfg.mask_truncated_completions, lockstep=self.lockstep)
        C = mb.completion_ids.shape[1]
        self.grad_sync(sync)
        if self.lockstep:
            self.dist.enter("forward (sharded)")
        logps, entropy = completion_logprobs(self.model, mb, cfg.temperature, with_entropy=True)  # (n, C)
        rows = lambda t: t[idx, :C].to(logps.device) if t is not None else None  # noqa: E731 - (N_rank, C') -> (n, C)
        old = rows(old_logps) if old_logps is not None else logps.detach()
        is_weights, is_metrics = None, {}
        if behav_logps is not None:
            is_weights, is_metrics = importance_weights(
                old, rows(behav_logps), mb.completion_mask, cfg.off_policy_correction,
                clip_max=cfg.importance_sampling_cap, clip_min=cfg.importance_sampling_clip_min,
            )  # fmt: skip
        loss, stats = policy_loss(
            logps, old, advantages[idx].to(logps.device), mb.completion_mask,
            loss_type=cfg.loss_type, norm=norm, epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high, delta=cfg.delta,
            importance_sampling_level=cfg.importance_sampling_level, beta=cfg.beta, ref_logprobs=rows(ref_logps), is_weights=is_weights,
        )  # fmt: skip
        stats.update(is_metrics)
        if sync and (self.dist.world > 1 or self.lockstep):
            self.dist.enter("backward (gradients synced)")
        self.dist.accelerator.backward(loss)
        mask = mb.completion_mask
        stats["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1.0)
        return loss.detach(), stats

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
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped
