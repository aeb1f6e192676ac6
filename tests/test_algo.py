"""The loss and advantage math against values worked out by hand in the comments."""

import math

import pytest
import torch

from tandem.algo import (
    LOSS_TYPES,
    Normalisation,
    entropy_bonus,
    group_advantages,
    high_entropy_mask,
    importance_weights,
    next_entropy_coef,
    off_policy_sequence_mask,
    policy_loss,
    step_token_normalizers,
    token_logprobs,
)
from tandem.algo.losses import get_reduction

pytestmark = pytest.mark.quick  # fast enough for the quick loop (README: Tests) as a whole

# Two sequences, three token slots; old log-probs 0 so ratio = exp(logprobs).
# row 0 (A = +1): ratios 1.5, 1.0, 0.5          all three tokens in the loss
# row 1 (A = -2): ratios 1.1, 0.7, (1.0 masked)  two tokens in the loss
RATIOS = torch.tensor([[1.5, 1.0, 0.5], [1.1, 0.7, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -2.0])
# Per-token loss -min(r*A, clip(r, 0.8, 1.2)*A):
# row 0: r=1.5 -> min(1.5, 1.2) = 1.2 -> -1.2 | r=1.0 -> -1.0 | r=0.5 -> min(0.5, 0.8) -> -0.5
#        sum -2.7, mean -0.9
# row 1: r=1.1 -> min(-2.2, -2.2) -> 2.2 | r=0.7 -> min(-1.4, -1.6) = -1.6 -> 1.6
#        sum 3.8, mean 1.9
# all 5 tokens: sum 1.1


def _loss(loss_type, norm=None, **kw):
    logprobs = RATIOS.log().clone().requires_grad_(True)
    norm = norm or Normalisation(max_completion_length=4)
    loss, metrics = policy_loss(logprobs, torch.zeros(2, 3), ADV, MASK, loss_type=loss_type, norm=norm, **kw)
    return loss, metrics, logprobs


@pytest.mark.parametrize(
    "loss_type, norm, expected",
    [
        ("grpo", Normalisation(4), (-0.9 + 1.9) / 2),  # mean of per-sequence means = 0.5
        ("bnpo", Normalisation(4), 1.1 / 5),  # token mean = 0.22
        ("dr_grpo", Normalisation(4), 1.1 / (2 * 4)),  # sum / (N * max_completion_length) = 0.1375
        ("dapo", Normalisation(4, step_tokens=11.0, world_size=2), 1.1 * 2 / 11),  # 0.2
        ("grpo", Normalisation(4, grad_accum=2), 0.25),  # each micro-batch carries 1/grad_accum
        ("bnpo", Normalisation(4, grad_accum=4), 0.055),
        ("dr_grpo", Normalisation(4, grad_accum=2), 0.06875),
    ],
)
def test_each_loss_type_normalises_as_worked_out(loss_type, norm, expected):
    loss, _, _ = _loss(loss_type, norm)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo"])
def test_a_sequence_split_over_rows_reduces_as_the_one_row_it_makes(loss_type):
    # Row 0 above cut after its first token into two rows of one sequence (an agent's trajectory
    # whose history was rewritten, Rollout.rows): the loss and its gradient are those of row 0
    # whole, whichever reduction. Counted as a sequence each, the rows weigh row 0 as two where a
    # reduction counts sequences (grpo, dr_grpo, luspo, sapo's grpo); bnpo's and dapo's do not.
    norm = Normalisation(4, step_tokens=5.0)
    whole, _, lp = _loss(loss_type, norm)
    whole.backward()
    ratios = torch.tensor([[1.5, 0.0, 0.0], [1.0, 0.5, 0.0], [1.1, 0.7, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    split_lp = ratios.clamp(min=1e-6).log().requires_grad_(True)
    split, _ = policy_loss(split_lp, torch.zeros(3, 3), torch.tensor([1.0, 1.0, -2.0]), mask, loss_type=loss_type, norm=norm,
                           sequences=torch.tensor([0, 0, 1]))  # fmt: skip
    split.backward()
    assert split.item() == pytest.approx(whole.item(), rel=1e-6)
    joined = torch.cat([split_lp.grad[0, :1], split_lp.grad[1, :2]])  # row 0's three tokens' gradients
    assert torch.allclose(joined, lp.grad[0], rtol=1e-6) and torch.allclose(split_lp.grad[2], lp.grad[1], rtol=1e-6)
    rows, _ = policy_loss(split_lp.detach(), torch.zeros(3, 3), torch.tensor([1.0, 1.0, -2.0]), mask, loss_type=loss_type, norm=norm)
    assert (rows.item() != pytest.approx(whole.item(), rel=1e-3)) == (loss_type in ("grpo", "dr_grpo", "luspo", "sapo"))


def test_every_registered_loss_type_is_covered():
    # each has a worked value above or below: the four clip reductions, then luspo, cispo, sapo, vespo
    assert set(LOSS_TYPES) == {"grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"}


def test_unknown_loss_type_lists_the_valid_names():
    with pytest.raises(ValueError, match="bnpo, cispo, dapo, dr_grpo, grpo, luspo, sapo, vespo"):
        get_reduction("ppo")


def test_luspo_sums_each_sequence_then_averages_over_sequences():
    # clip losses as above: row 0 sums to -2.7, row 1 to 3.8; (-2.7 + 3.8) / 2 = 0.55, / grad_accum 2
    loss, _, _ = _loss("luspo", Normalisation(4, grad_accum=2))
    assert loss.item() == pytest.approx(0.55 / 2, rel=1e-6)


def test_cispo_clamps_the_weight_and_keeps_every_tokens_gradient():
    # epsilon_high 1.2 bounds the weight w = sg(min(r, 1.2)); per token -w A ln r, dapo's sum / 5 tokens:
    # row 0 (A = 1):  -1.2 ln 1.5 = -0.486558 | 0 | -0.5 ln 0.5 = 0.346574
    # row 1 (A = -2): 2.2 ln 1.1 = 0.209682 | 1.4 ln 0.7 = -0.499345
    # sum -0.429647 / 5 = -0.0859294
    loss, metrics, logprobs = _loss("cispo", Normalisation(4, step_tokens=5.0), epsilon_high=1.2)
    assert loss.item() == pytest.approx(-0.0859294, rel=1e-5)
    assert metrics["cispo_clip_ratio"].item() == pytest.approx(0.2)  # r = 1.5 > 1.2 with A > 0: 1 token of 5
    loss.backward()
    # d/d ln r of -w A ln r is -w A / 5: the clamped token keeps its gradient (-1.2 / 5), unlike the clip's 0
    assert logprobs.grad[0, 0].item() == pytest.approx(-1.2 / 5) and logprobs.grad[1, 1].item() == pytest.approx(0.7 * 2 / 5)
    assert logprobs.grad[1, 2] == 0  # masked


def test_sapo_gates_the_ratio_with_a_sigmoid_by_the_advantages_sign():
    # -(4 / tau) sigmoid(tau (r - 1)) A; tau 1.0 for A > 0, 1.05 for A < 0; grpo's mean of sequence means:
    # row 0: -4 [s(0.5), s(0), s(-0.5)] = -2.489837, -2, -1.510163; mean -2 (s(x) + s(-x) = 1)
    # row 1: (4 / 1.05) 2 [s(0.105), s(-0.315)] = 4.009340, 3.214436; mean 3.611888
    # (-2 + 3.611888) / 2 = 0.805944
    loss, _, logprobs = _loss("sapo")
    assert loss.item() == pytest.approx(0.8059441, rel=1e-6)
    loss.backward()
    # at r = 1 the gate's slope is 4 s(0)(1 - s(0)) = 1: the gradient of -r A, (1/3 of row 0's mean, / 2 rows)
    assert logprobs.grad[0, 1].item() == pytest.approx(-1.0 / 3 / 2, rel=1e-6)


def test_vespo_weighs_each_sequence_by_a_gamma_of_its_ratio():
    # w = product of the ratios: row 0 0.75 (A >= 0: k 2, lambda 3), row 1 0.77 (A < 0: k 3, lambda 2)
    # phi = exp(lambda + k ln w - lambda w): row 0 exp(3 - 0.575364 - 2.25) = 1.190813
    #                                       row 1 exp(2 - 0.784096 - 1.54) = 0.723182
    # per token -phi A ln r: row 0 -0.482833, 0, 0.825408; row 1 0.137853, -0.515882; dapo: sum / 5
    loss, metrics, _ = _loss("vespo", Normalisation(4, step_tokens=5.0))
    assert loss.item() == pytest.approx(-0.00709064, rel=1e-5)
    assert metrics["vespo/phi_seq_mean"].item() == pytest.approx((1.1908125 + 0.7231820) / 2, rel=1e-6)
    # The off-policy weights join w (in log space) instead of multiplying the loss: weights of 2 on
    # row 0's three tokens make its w 6, phi exp(3 + 2 ln 6 - 18) = 1.1012e-5, and the loss almost row 1's alone.
    weights = torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 0.0]])
    weighted, _, _ = _loss("vespo", Normalisation(4, step_tokens=5.0), is_weights=weights)
    row0 = -math.exp(3 + 2 * math.log(6.0) - 18) * (math.log(1.5) + math.log(0.5))
    assert weighted.item() == pytest.approx((row0 + 0.1378532 - 0.5158818) / 5, rel=1e-5)


def test_the_kl_bias_correction_weighs_the_kl_by_the_ratio_with_its_gradient():
    # TRL's use_bias_correction_kl: k3 times r (current/proximal), r carrying gradient. Old = current
    # (r = 1): the value is the plain KL's, the gradient is not: d(k3 r)/d ln pi = dk3/d ln pi + k3.
    lp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]])  # d = ref - lp = -ln 2; k3 = 0.5 + ln 2 - 1 = 0.193147
    args = dict(loss_type="bnpo", norm=Normalisation(1), beta=1.0, ref_logprobs=ref)
    plain, _ = policy_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 1), **args)
    (g_plain,) = torch.autograd.grad(plain, lp)
    corrected, _ = policy_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 1), kl_bias_correction=True, **args)
    (g_corrected,) = torch.autograd.grad(corrected, lp)
    assert plain.item() == pytest.approx(0.5 + math.log(2) - 1) and corrected.item() == pytest.approx(plain.item())
    # dk3/d lp = -e^d + 1 = 0.5; plus k3 = 0.193147
    assert g_plain.item() == pytest.approx(0.5) and g_corrected.item() == pytest.approx(0.5 + 0.5 + math.log(2) - 1)


def test_off_policy_sequence_mask_drops_negative_advantage_sequences_that_drifted():
    # mean KL estimate (sampling - current) per sequence: row 0 0.3, row 1 0.3, row 2 0.05
    current = torch.zeros(3, 2)
    sampling = torch.tensor([[0.6, 0.0], [0.3, 0.3], [0.1, float("nan")]])  # NaN: a token the sampler could not score, counted 0
    mask = torch.ones(3, 2)
    keep = off_policy_sequence_mask(current, sampling, torch.tensor([1.0, -1.0, -1.0]), mask, threshold=0.2)
    assert keep.squeeze(-1).tolist() == [1.0, 0.0, 1.0]  # row 0 kept for its positive advantage, row 2 for its low KL
    # In the loss it leaves the dropped sequence's KL term and its tokens' count in the reduction.
    loss, _ = policy_loss(RATIOS.log(), torch.zeros(2, 3), ADV, MASK, loss_type="bnpo", norm=Normalisation(4), keep=torch.tensor([[1.0], [0.0]]))
    assert loss.item() == pytest.approx(-2.7 / 5)


def test_high_entropy_tokens_and_the_entropy_bonus():
    entropy = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.2, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert high_entropy_mask(entropy, mask, threshold=0.5).tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]  # the masked 3.0 never
    # -coef * mean entropy of the masked tokens (0.1 + 0.9 + 0.5 + 0.7 + 0.2 = 2.4 over 5) / grad_accum
    assert entropy_bonus(entropy, mask, coef=0.5, grad_accum=2).item() == pytest.approx(-0.5 * 0.48 / 2)
    # adaptive: up by delta at or below the target, down above it, within the bounds
    assert next_entropy_coef(0.1, world_entropy=0.2, target=0.2, delta=0.05, lowest=0.0, highest=0.12) == 0.12
    assert next_entropy_coef(0.1, world_entropy=0.3, target=0.2, delta=0.05, lowest=0.0, highest=1.0) == pytest.approx(0.05)
    assert next_entropy_coef(0.02, world_entropy=0.3, target=0.2, delta=0.05, lowest=0.0, highest=1.0) == 0.0


def test_clip_metrics_and_clipped_tokens_get_no_gradient():
    loss, metrics, logprobs = _loss("bnpo")
    # low: r < 0.8 with A < 0 -> row 1 token 1; high: r > 1.2 with A > 0 -> row 0 token 0; of 5 tokens
    assert metrics["clip_ratio/low_mean"].item() == pytest.approx(0.2)
    assert metrics["clip_ratio/high_mean"].item() == pytest.approx(0.2)
    assert metrics["clip_ratio/region_mean"].item() == pytest.approx(0.4)
    loss.backward()
    g = logprobs.grad
    assert g[0, 0] == 0 and g[1, 1] == 0  # clipped
    assert g[1, 2] == 0  # masked
    # unclipped: d(-r*A/5)/dlogp = -A*r/5
    assert g[0, 1].item() == pytest.approx(-1.0 * 1.0 / 5)
    assert g[0, 2].item() == pytest.approx(-1.0 * 0.5 / 5)
    assert g[1, 0].item() == pytest.approx(2.0 * 1.1 / 5)


def test_at_sequence_level_the_clip_metrics_are_shares_of_sequences_as_trls():
    # GSPO's ratio is one per sequence: row 0's exp(mean(ln 1.5, 0, ln 0.5)) = 0.9086 with A = 1;
    # row 1's exp(mean(ln 1.1, ln 0.7)) = 0.8775 with A = -2, and epsilon 0.1 puts it under 0.9:
    # clipped low. One sequence of two: 0.5 (counted by tokens it was 2 of 5, 0.4). A third row
    # without a loss token (truncated and masked) counts in neither share.
    lp = torch.cat([RATIOS.log(), torch.tensor([[math.log(2.0)] * 3])])  # (3, 3)
    mask, adv = torch.cat([MASK, torch.zeros(1, 3)]), torch.tensor([1.0, -2.0, 1.0])
    kw = dict(norm=Normalisation(4), importance_sampling_level="sequence", epsilon_low=0.1, epsilon_high=0.1)
    _, metrics = policy_loss(lp, torch.zeros(3, 3), adv, mask, loss_type="grpo", **kw)
    assert (metrics["clip_ratio/low_mean"].item(), metrics["clip_ratio/high_mean"].item(), metrics["clip_ratio/region_mean"].item()) == (0.5, 0.0, 0.5)
    # cispo's share at sequence level: row 0's ratio exp(mean(ln 3, ln 3, ln 3)) = 3 > epsilon_high 2 with A > 0
    lp = torch.tensor([[math.log(3.0)] * 3, [0.0, 0.0, 0.0]])
    _, metrics = policy_loss(lp, torch.zeros(2, 3), ADV, MASK, loss_type="cispo", norm=Normalisation(4, step_tokens=5.0),
                             importance_sampling_level="sequence", epsilon_high=2.0)  # fmt: skip
    assert metrics["cispo_clip_ratio"].item() == 0.5  # (by tokens 3 of 5)


def test_dapos_divisor_is_each_steps_own_tokens_or_trls_mean_over_the_round():
    # A round of 2 passes (num_iterations) x 3 optimizer steps of 12, 4 and 8 loss tokens (then
    # 6, 6, 12): 'step' divides each by its own; 'round_mean' by the round's 24 / 3 = 8 for every
    # step, TRL 1.16's generation batch tokens x GA / steps_per_generation.
    counts = torch.tensor([[12.0, 4.0, 8.0], [6.0, 6.0, 12.0]])
    assert torch.equal(step_token_normalizers(counts, "step"), counts)
    assert torch.equal(step_token_normalizers(counts, "round_mean"), torch.full((2, 3), 8.0))
    with pytest.raises(ValueError, match="unknown token_normalizer 'tokens'; valid names: step, round_mean"):
        step_token_normalizers(counts, "tokens")


def test_epsilon_high_widens_only_the_upper_bound():
    # With epsilon_high 0.6 the 1.5 ratio of row 0 is no longer clipped: -1.5 instead of -1.2.
    loss, metrics, _ = _loss("bnpo", epsilon_low=0.2, epsilon_high=0.6)
    assert loss.item() == pytest.approx((1.1 - 0.3) / 5)
    assert metrics["clip_ratio/high_mean"].item() == 0


def test_delta_caps_the_unclipped_ratio_for_negative_advantages():
    # One token, A = -2, ratio 3: without delta -min(-6, -2.4) = 6; delta 1.4 caps it: -min(-2.8, -2.4) = 2.8
    lp, old, adv, mask = torch.tensor([[math.log(3.0)]]), torch.zeros(1, 1), torch.tensor([-2.0]), torch.ones(1, 1)
    plain, _ = policy_loss(lp, old, adv, mask, loss_type="bnpo", norm=Normalisation(1))
    capped, _ = policy_loss(lp, old, adv, mask, loss_type="bnpo", norm=Normalisation(1), delta=1.4)
    assert plain.item() == pytest.approx(6.0)
    assert capped.item() == pytest.approx(2.8)


def test_sequence_level_ratio_is_gspo_length_normalised():
    # row 0: exp(mean(ln1.5, 0, ln0.5)) = 0.75^(1/3) = 0.90856, inside [0.8, 1.2]: -0.90856 per token
    # row 1: exp(mean(ln1.1, ln0.7)) = 0.77^(1/2) = 0.87750, A = -2: 1.75499 per token
    loss, _, _ = _loss("grpo", importance_sampling_level="sequence")
    assert loss.item() == pytest.approx((-(0.75 ** (1 / 3)) + 2 * 0.77**0.5) / 2, rel=1e-6)


def test_k3_kl_penalty():
    # ref - logp = d; k3 = e^d - d - 1. Row 0: d = ln(2) - ln(1.5) etc.; check against a plain loop.
    ref = torch.log(torch.tensor([[2.0, 1.0, 0.25], [1.1, 1.4, 9.0]]))
    beta = 0.1
    loss_kl, metrics = policy_loss(
        RATIOS.log(), torch.zeros(2, 3), ADV, MASK, loss_type="bnpo", norm=Normalisation(4), beta=beta, ref_logprobs=ref
    )
    kl = []
    for i in range(2):
        for t in range(3):
            if MASK[i, t]:
                d = math.log(ref[i, t].exp().item()) - math.log(RATIOS[i, t].item())
                kl.append(math.exp(d) - d - 1)
    assert metrics["kl"].item() == pytest.approx(sum(kl) / 5, rel=1e-5)
    assert loss_kl.item() == pytest.approx(1.1 / 5 + beta * sum(kl) / 5, rel=1e-5)


def test_kl_needs_reference_logprobs():
    with pytest.raises(ValueError, match="ref_logprobs"):
        _loss("grpo", beta=0.1)


def test_advantages_group_batch_none():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735; group 2: all equal -> 0
    adv, stats = group_advantages(r, 4, "group")
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert adv.tolist() == pytest.approx([a, -a, -a, a, 0, 0, 0, 0], rel=1e-6)
    assert stats["frac_groups_zero_std"].item() == 0.5
    # batch: mean 0.25, var (2 * 0.5625 + 6 * 0.0625) / 7 = 0.2142857
    adv, _ = group_advantages(r, 4, "batch")
    b = 0.5 / (math.sqrt(1.5 / 7) + 1e-4)
    assert adv.tolist() == pytest.approx([b, -b, -b, b, 0, 0, 0, 0], rel=1e-6)
    adv, _ = group_advantages(r, 4, "none")
    assert adv.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


@pytest.mark.parametrize("scale", [1e20, 1e38])
def test_advantages_do_not_depend_on_the_reward_scale(scale):
    # The pattern above times `scale`: the std is scale * sqrt(1/3) (group) or scale * sqrt(1.5/7)
    # (batch), so eps = 1e-4 vanishes beside it and the advantages are 0.5 / std * scale, the same
    # at every scale. In float32 the squared deviations (0.25 * scale^2) overflowed from 1e19 on:
    # the std became inf and every advantage 0, or garbage near 1e38.
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]) * scale
    a, b = 0.5 / math.sqrt(1 / 3), 0.5 / math.sqrt(1.5 / 7)
    assert group_advantages(r, 4, "group")[0].tolist() == pytest.approx([a, -a, -a, a, 0, 0, 0, 0], rel=1e-6)
    assert group_advantages(r, 4, "batch")[0].tolist() == pytest.approx([b, -b, -b, b, 0, 0, 0, 0], rel=1e-6)
    assert group_advantages(r, 4, "group")[0].dtype == torch.float32


def test_nan_rewards_are_left_out_of_group_statistics():
    # valid [1, 0, 0]: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    adv, _ = group_advantages(torch.tensor([1.0, float("nan"), 0.0, 0.0]), 4, "group")
    s = math.sqrt(1 / 3) + 1e-4
    assert adv.tolist() == pytest.approx([(2 / 3) / s, 0.0, -(1 / 3) / s, -(1 / 3) / s], rel=1e-6)
    adv, _ = group_advantages(torch.full((4,), float("nan")), 4, "group")
    assert adv.tolist() == [0.0] * 4


def test_advantages_reject_partial_groups():
    with pytest.raises(ValueError, match="G=4"):
        group_advantages(torch.zeros(6), 4)


def test_token_logprobs_apply_temperature():
    # logits [0, ln 3]: p = [1/4, 3/4]. At T=2 the logits halve: p1 = sqrt(3) / (1 + sqrt(3)).
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    tok = torch.tensor([[1]])
    assert token_logprobs(logits, tok).item() == pytest.approx(math.log(0.75))
    assert token_logprobs(logits, tok, 2.0).item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))))


def test_bf16_logprobs_match_a_plain_fp32_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 50)
    tok = torch.randint(50, (3, 5))
    ref = torch.log_softmax(logits.to(torch.bfloat16).float(), -1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(token_logprobs(logits.to(torch.bfloat16), tok), ref, atol=1e-6)


# Importance weights proximal/behaviour. Row 0: token ratios 2, 1, 0.5 (product 1); row 1: ratios
# 2, 2 and a masked slot (product 4). Cap 1.5.
PROX = torch.log(torch.tensor([[0.5, 0.5, 0.25], [0.5, 0.5, 0.3]]))
BEHAV = torch.log(torch.tensor([[0.25, 0.5, 0.5], [0.25, 0.25, 0.1]]))
IS_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("none", [[1, 1, 1], [1, 1, 0]]),
        ("token_truncate", [[1.5, 1, 0.5], [1.5, 1.5, 0]]),  # 2 -> 1.5
        ("token_mask", [[0, 1, 0.5], [0, 0, 0]]),  # 2 > 1.5 -> dropped
        ("sequence_truncate", [[1, 1, 1], [1.5, 1.5, 0]]),  # row 1: 2 * 2 = 4 -> 1.5
        ("sequence_mask", [[1, 1, 1], [0, 0, 0]]),  # row 1 dropped whole
    ],
)
def test_importance_weight_modes(mode, expected):
    w, _ = importance_weights(PROX, BEHAV, IS_MASK, mode, clip_max=1.5)
    assert torch.allclose(w, torch.tensor(expected, dtype=w.dtype), atol=1e-6), w


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token_truncate", [[1.5, 1, 0.8], [1.5, 1.5, 0]]),  # 0.5 raised to 0.8, 2 lowered to 1.5
        ("token_mask", [[0, 1, 0], [0, 0, 0]]),  # 0.5 < 0.8 and 2 > 1.5 dropped
        ("sequence_truncate", [[1, 1, 1], [1.5, 1.5, 0]]),  # products 1 and 4
    ],
)
def test_importance_weight_lower_bound(mode, expected):
    w, _ = importance_weights(PROX, BEHAV, IS_MASK, mode, clip_max=1.5, clip_min=0.8)
    assert torch.allclose(w, torch.tensor(expected, dtype=w.dtype), atol=1e-6), w


def test_sequence_weight_is_the_product_of_token_ratios_not_their_geometric_mean():
    # Row 1: token ratios 2 and 2 in the mask, 3 in the masked slot. The product 4 is truncated
    # to 3, where a geometric mean (2) would pass. With bound 5 the mask mode keeps 4: a
    # geometric mean would give 2, and a product over the masked slot too (12) would be dropped.
    w, _ = importance_weights(PROX, BEHAV, IS_MASK, "sequence_truncate", clip_max=3.0)
    assert torch.allclose(w, torch.tensor([[1.0, 1, 1], [3, 3, 0]]), atol=1e-6), w
    w, _ = importance_weights(PROX, BEHAV, IS_MASK, "sequence_mask", clip_max=5.0)
    assert torch.allclose(w, torch.tensor([[1.0, 1, 1], [4, 4, 0]]), atol=1e-6), w  # masked slot (x3) left out


def test_importance_weight_metrics_report_the_weights_applied():
    _, m = importance_weights(PROX, BEHAV, IS_MASK, "token_truncate", clip_max=1.5)
    # token ratios over the 5 tokens in the mask: 2, 1, 0.5, 2, 2; applied after the cap: 1.5, 1, 0.5, 1.5, 1.5
    assert m["is_weight/mean"].item() == pytest.approx(6.0 / 5)
    assert m["is_weight/min"].item() == pytest.approx(0.5)
    assert m["is_weight/max"].item() == pytest.approx(1.5)
    assert m["is_weight/frac_capped"].item() == pytest.approx(3 / 5)
    # the raw ratio, in log space: ln 2 three times, 0, -ln 2
    ln2 = math.log(2)
    assert m["is_log_ratio/mean"].item() == pytest.approx(2 * ln2 / 5, rel=1e-6)
    assert m["is_log_ratio/max"].item() == pytest.approx(ln2, rel=1e-6)
    assert m["is_log_ratio/min"].item() == pytest.approx(-ln2, rel=1e-6)
    # k3 of KL(behaviour || proximal): r - 1 - ln r; r=2: 1 - ln 2, r=1: 0, r=0.5: ln 2 - 0.5
    k2, k05 = 1 - math.log(2), math.log(2) - 0.5
    assert m["kl_behav_proximal"].item() == pytest.approx((3 * k2 + k05) / 5, rel=1e-5)


def test_importance_weights_scale_only_the_policy_term():
    # bnpo over the worked example above with weights 0.5 everywhere: half the loss.
    logprobs = RATIOS.log()
    norm = Normalisation(4)
    plain, _ = policy_loss(logprobs, torch.zeros(2, 3), ADV, MASK, loss_type="bnpo", norm=norm)
    halved, _ = policy_loss(logprobs, torch.zeros(2, 3), ADV, MASK, loss_type="bnpo", norm=norm, is_weights=torch.full((2, 3), 0.5))
    assert halved.item() == pytest.approx(plain.item() / 2)


def test_importance_weights_scale_the_policy_term_but_not_the_kl_term():
    # With weights 0.5 and beta 0.1: loss = 0.5 * (policy term) + 0.1 * (kl term), the KL unweighted.
    ref = torch.log(torch.tensor([[2.0, 1.0, 0.25], [1.1, 1.4, 9.0]]))
    norm, kw = Normalisation(4), dict(loss_type="bnpo", beta=0.1, ref_logprobs=ref)
    plain, m = policy_loss(RATIOS.log(), torch.zeros(2, 3), ADV, MASK, norm=norm, **kw)
    halved, _ = policy_loss(RATIOS.log(), torch.zeros(2, 3), ADV, MASK, norm=norm, is_weights=torch.full((2, 3), 0.5), **kw)
    kl_term = 0.1 * m["kl"].item()  # bnpo: the KL term is 0.1 * token mean of k3
    assert halved.item() == pytest.approx(0.5 * (plain.item() - kl_term) + kl_term, rel=1e-6)


def test_sequence_level_ratio_leaves_masked_tokens_out():
    # The masked slot of row 1 now has log ratio ln 5: summed without the mask, row 1's mean
    # log ratio would be (ln 1.1 + ln 0.7 + ln 5) / 2 and its ratio 1.96, not 0.8775.
    old = torch.zeros(2, 3)
    old[1, 2] = -math.log(5.0)
    loss, _, _ = _loss("grpo", importance_sampling_level="sequence")
    masked_old, _ = policy_loss(RATIOS.log(), old, ADV, MASK, loss_type="grpo", norm=Normalisation(4), importance_sampling_level="sequence")
    assert masked_old.item() == pytest.approx(loss.item(), rel=1e-6)
    assert masked_old.item() == pytest.approx((-(0.75 ** (1 / 3)) + 2 * 0.77**0.5) / 2, rel=1e-6)


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate"])
def test_sequence_weights_that_overflow_float32_stay_finite(mode):
    # 2000 tokens that drifted 0.05 each: sum of log ratios 100, exp(100) overflows float32.
    T = 2000
    prox = torch.full((2, T), -1.0)
    behav = torch.cat([torch.full((1, T), -1.05), torch.full((1, T), -1.0)])  # row 0 drifted, row 1 on-policy
    mask = torch.ones(2, T)
    w, m = importance_weights(prox, behav, mask, mode, clip_max=3.0)
    row0 = 0.0 if mode == "sequence_mask" else 3.0  # dropped whole, or truncated to the cap
    assert torch.equal(w[0], torch.full((T,), row0)) and torch.allclose(w[1], torch.ones(T))
    assert all(torch.isfinite(v) for v in m.values()), m
    assert m["is_log_ratio/max"].item() == pytest.approx(100.0, rel=1e-4)
    # and through the loss: finite, with a finite gradient
    logprobs = prox.clone().requires_grad_(True)
    loss, _ = policy_loss(logprobs, prox, torch.tensor([1.0, -1.0]), mask, loss_type="dapo",
                          norm=Normalisation(T, step_tokens=2.0 * T), is_weights=w)  # fmt: skip
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()


def test_dapo_step_without_loss_tokens_has_loss_zero():
    # every completion truncated and masked: no token in the step, the loss is 0 (not 0/0)
    logprobs = RATIOS.log().clone().requires_grad_(True)
    loss, _ = policy_loss(logprobs, torch.zeros(2, 3), ADV, torch.zeros(2, 3), loss_type="dapo", norm=Normalisation(4, step_tokens=0.0))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logprobs.grad, torch.zeros(2, 3))
