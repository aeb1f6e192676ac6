"""tandem's loss against TRL 1.16's own loss code, on identical float64 inputs.

    python bench/trl_parity.py        (runs itself in bench/.venv-trl, made as bench/vs_trl.py makes it)

TRL's GRPOTrainer._compute_loss is called on a stand-in for the trainer that holds only what the
method reads (its options, one process, the log-probs of a micro-batch handed over instead of a
model's forward); tandem's policy_loss gets the same tensors. For every combination of loss type,
beta, bias-corrected KL, importance-sampling level, epsilon_high, delta, a truncated row masked or
not, off-policy weights (TRL's vLLM correction, given to both as the same tensor) and rounds of one
or two optimizer steps, it prints the largest relative difference of the loss, the gradient of
the log-probs and the metrics both report, and lists the combinations past 1e-12. Off-policy
weights and advantages are computed by other TRL methods than this one: tests/test_algo.py
checks tandem's against values worked out by hand.
"""

import itertools
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent


def main() -> None:
    import torch
    from trl import GRPOTrainer

    sys.path.insert(0, str(HERE.parent))
    from tandem.algo import Normalisation, Objective, policy_loss

    torch.manual_seed(0)
    B, T = 6, 7
    g = torch.Generator().manual_seed(1)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3  # (B, T) current
    old = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3  # (B, T) proximal
    ref = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2  # (B, T) reference
    adv = torch.randn(B, generator=g, dtype=torch.float64)  # (B,)
    lengths = torch.tensor([7, 5, 3, 7, 2, 6])
    full_mask = (torch.arange(T) < lengths.unsqueeze(1)).double()  # (B, T)
    is_weights = torch.exp(torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2).clamp(max=3.0) * full_mask  # (B, T)
    worst: dict[str, float] = defaultdict(float)
    differ: dict[str, float] = defaultdict(float)
    failures, combos = [], 0
    grid = itertools.product(
        ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"], [0.0, 0.04], [True, False], ["token", "sequence"],
        [None, 0.28], [None, 1.5], [False, True], [False, True], [(1, 1), (2, 1)],
    )  # fmt: skip
    for loss_type, beta, bias_kl, level, eps_high, delta, masked, with_is, (spg, ga) in grid:
        if delta is not None and loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            continue  # delta is the clip's
        combos += 1
        eps_high_value = (5.0 if loss_type == "cispo" else 0.2) if eps_high is None else (eps_high if loss_type != "cispo" else 4.0)
        mask = full_mask.clone()
        if masked:
            mask[3] = 0  # a truncated completion, masked (mask_truncated_completions)
        round_tokens = mask.sum() * spg / ga + 5  # the round's other steps hold more tokens than this one
        # Off-policy weights as each pipeline makes them: TRL's are 1 outside the loss mask (its
        # log-prob difference is masked to 0 there), tandem's importance_weights 0.
        weights = is_weights * mask if with_is else None

        # --- TRL's code ---
        current = logps.clone().requires_grad_()
        entropies = torch.rand(B, T, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        args = SimpleNamespace(delta=delta, use_bias_correction_kl=bias_kl, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                               vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, steps_per_generation=spg,
                               entropy_target=0.2)  # fmt: skip
        accelerator = SimpleNamespace(num_processes=1, gather=lambda t: t, gather_for_metrics=lambda t: t, reduce=lambda t, reduction="sum": t,
                                      sync_gradients=True, pad_across_processes=lambda t, **_: t)  # fmt: skip
        metrics = defaultdict(lambda: defaultdict(list))
        stand_in = SimpleNamespace(
            _get_per_token_logps_and_entropies=lambda *a, **k: (current, entropies, None), aux_loss_enabled=False, top_entropy_quantile=1.0,
            off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta, args=args, loss_type=loss_type, epsilon_low=0.2,
            epsilon_high=eps_high_value, use_vllm=with_is, vllm_importance_sampling_correction=with_is, model=SimpleNamespace(training=True),
            current_gradient_accumulation_steps=ga, accelerator=accelerator, max_completion_length=T, _entropy_bonus_enabled=False,
            _metrics=metrics, get_gamma_weights=GRPOTrainer.get_gamma_weights, get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        )  # fmt: skip
        inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
                  "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask.long(), "advantages": adv,
                  "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": round_tokens}  # fmt: skip
        if with_is:
            inputs["importance_sampling_ratio"] = torch.where(mask > 0, weights, 1.0)
        trl_loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
        trl_loss.backward()
        trl_grad = current.grad.clone()
        trl_metrics = {k: v[0] for k, v in metrics["train"].items() if k in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
                                                                              "clip_ratio/region_mean", "cispo_clip_ratio")}  # fmt: skip

        # --- tandem's: with TRL's divisor (token_normalizer round_mean), and with its own (step) ---
        def tandem(step_tokens: float):
            current = logps.clone().requires_grad_()
            objective = Objective(epsilon_low=0.2, epsilon_high=eps_high_value, delta=delta)
            norm = Normalisation(max_completion_length=T, grad_accum=ga, step_tokens=step_tokens, world_size=1)
            loss, stats = policy_loss(current, old, adv, mask, loss_type=loss_type, norm=norm, epsilon_low=0.2, epsilon_high=eps_high_value,
                                      delta=delta, importance_sampling_level=level, beta=beta, ref_logprobs=ref if beta else None,
                                      is_weights=weights, kl_bias_correction=bias_kl and beta != 0.0, objective=objective)  # fmt: skip
            loss.backward()
            return loss, current.grad, stats

        loss, grad, stats = tandem(float(round_tokens) * ga / spg)
        name = f"{loss_type} beta={beta} bias_kl={bias_kl} {level} eps_high={eps_high} delta={delta} masked={masked} is={with_is} spg={spg}"
        diffs = {"loss": _rel(loss, trl_loss), "gradient": _rel(grad, trl_grad)}
        # TRL computes its metrics in float32: equal up to its rounding. At sequence level a row
        # without a loss token is left out of tandem's shares, counted unclipped in TRL's.
        deliberate = level == "sequence" and masked
        diffs |= {k: _rel(stats[k], torch.tensor(v, dtype=torch.float64)) for k, v in trl_metrics.items() if k in stats}
        for k, d in diffs.items():
            bound = 1e-12 if k in ("loss", "gradient") else 1e-6
            if deliberate and k not in ("loss", "gradient", "kl"):
                differ[k] = max(differ[k], d)
                continue
            worst[k] = max(worst[k], d)
            if d > bound:
                failures.append(f"{name}: {k} differs by {d:.2g} (relative)")
        if loss_type in ("dapo", "cispo", "vespo") and spg > ga:
            own = tandem(float(mask.sum()))[0]
            differ["loss, token_normalizer step"] = max(differ["loss, token_normalizer step"], _rel(own, trl_loss))
    print(f"{combos} combinations; the largest relative difference from TRL 1.16's _compute_loss (token_normalizer round_mean):")
    for k, d in worst.items():
        print(f"  {k:26s} {d:.1e}")
    print("where tandem differs on purpose (docs/configuration.md), the largest relative difference:")
    for k, d in differ.items():
        print(f"  {k:26s} {d:.1e}" + ("  (clip shares at sequence level, a masked row)" if "clip" in k else ""))
    print("past the bounds (1e-12 for loss and gradient, 1e-6 for TRL's float32 metrics):" if failures else "none past the bounds (1e-12 for loss and gradient, 1e-6 for TRL's float32 metrics)")
    for line in failures:
        print("  " + line)


def _rel(a, b) -> float:
    import torch

    a, b = torch.as_tensor(a, dtype=torch.float64).detach(), torch.as_tensor(b, dtype=torch.float64).detach()
    scale = max(b.abs().max().item(), 1e-300)
    return (a - b).abs().max().item() / scale if math.isfinite(scale) else math.inf


if __name__ == "__main__":
    trl_python = HERE / ".venv-trl" / "bin" / "python"
    if Path(sys.prefix).resolve() != (HERE / ".venv-trl").resolve():
        sys.path.insert(0, str(HERE))
        from vs_trl import ensure_trl

        ensure_trl()
        sys.exit(subprocess.call([str(trl_python), __file__], env={**os.environ, "PYTHONPATH": str(HERE.parent)}))
    main()
