"""Pure tensor math of GRPO: tensors and plain numbers in, (value, metrics) out."""

from tandem.algo.advantages import SCALE_REWARDS, group_advantages, nanstd, zero_std_groups
from tandem.algo.importance import OFF_POLICY_CORRECTIONS, importance_weights
from tandem.algo.logprobs import entropy_from_logits, scaled, selective_log_softmax, selective_log_softmax_into, token_logprobs
from tandem.algo.losses import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    TOKEN_NORMALIZERS,
    Normalisation,
    Objective,
    entropy_bonus,
    get_reduction,
    high_entropy_mask,
    next_entropy_coef,
    off_policy_sequence_mask,
    policy_loss,
    register_loss,
    step_token_normalizers,
)

__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "LOSS_TYPES",
    "OFF_POLICY_CORRECTIONS",
    "SCALE_REWARDS",
    "TOKEN_NORMALIZERS",
    "Normalisation",
    "Objective",
    "entropy_bonus",
    "entropy_from_logits",
    "get_reduction",
    "group_advantages",
    "high_entropy_mask",
    "importance_weights",
    "nanstd",
    "next_entropy_coef",
    "off_policy_sequence_mask",
    "policy_loss",
    "register_loss",
    "scaled",
    "selective_log_softmax",
    "step_token_normalizers",
    "token_logprobs",
    "zero_std_groups",
]
