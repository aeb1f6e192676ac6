"""LoRA adapter updates: what a trainer pushes instead of the whole model, and how a rollout
server turns it into weights its engine serves.

An adapter update names tensors by the base weight they change:
  "<weight>.lora_A"  (r, in)   and  "<weight>.lora_B"  (out, r), the scale alpha / r folded into B,
for every adapted linear layer, and "<weight>" itself, whole, for a module trained in full
(lora_modules_to_save). The server keeps the base weights (the full weights it held when the
first adapter update arrived) and serves base + B @ A, merged once per update in float32, so
generation costs what it costs without adapters and every engine serves them the same way.
"""

import torch

from tandem.rollout.weights import check_values, check_weights

LORA_A, LORA_B = ".lora_A", ".lora_B"


def target_of(name: str) -> tuple[str, str | None]:
    """(base weight, "A" or "B") for a factor's name; (name, None) for a whole weight."""
    for suffix, factor in ((LORA_A, "A"), (LORA_B, "B")):
        if name.endswith(suffix):
            return name[: -len(suffix)], factor
    return name, None


def check_adapter(spec: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless every tensor is a LoRA factor that fits a 2-D weight of the
    served model, or a whole weight (check_weights' rules). Checked as each chunk arrives."""
    whole = {n: t for n, t in tensors.items() if target_of(n)[1] is None}
    factors = {n: t for n, t in tensors.items() if n not in whole}
    check_weights(spec, whole, complete=False)
    for name, t in factors.items():
        target, factor = target_of(name)
        base = spec.get(target)
        if base is None or base.dim() != 2:
            raise ValueError(f"adapter tensor {name!r}: the served model has no 2-D weight {target!r}")
        fits = t.dim() == 2 and (t.shape[1] == base.shape[1] if factor == "A" else t.shape[0] == base.shape[0])
        if not fits:
            need = f"{base.shape[1]} columns" if factor == "A" else f"{base.shape[0]} rows"
            raise ValueError(f"adapter tensor {name!r}: shape {tuple(t.shape)} does not fit {target!r} {tuple(base.shape)}; lora_{factor} is 2-D with {need}")
        check_values(name, t)


def check_pairs(tensors: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless every factor of a whole update has its partner, the two agree on
    the rank, and no weight came both whole and as factors (the chunks were checked one by one)."""
    for name in tensors:
        target, factor = target_of(name)
        if factor is None:
            continue
        if target in tensors:
            raise ValueError(f"adapter tensor {name!r}: {target!r} also arrived whole; send a weight either whole or as LoRA factors")
        partner = target + (LORA_B if factor == "A" else LORA_A)
        if partner not in tensors:
            raise ValueError(f"adapter tensor {name!r} arrived without its partner {partner!r}")
        a, b = tensors[target + LORA_A], tensors[target + LORA_B]
        if a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter tensors of {target!r}: lora_A has rank {a.shape[0]}, lora_B rank {b.shape[1]}")


def merge(base: dict[str, torch.Tensor], update: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every weight of the model: base + B @ A where the update adapts it (in float32, then the
    base's dtype), the update's tensor where it replaces it whole, else the base tensor itself."""
    merged = dict(base)
    for name, t in update.items():
        target, factor = target_of(name)
        w = base[target]
        if factor is None:
            merged[name] = t.to(device=w.device, dtype=w.dtype)
        elif factor == "A":
            a, b = t.to(w.device, torch.float32), update[target + LORA_B].to(w.device, torch.float32)
            merged[target] = (w.float() + b @ a).to(w.dtype)
    return merged
