"""LoRA training on PEFT: the adapted policy, what a weight sync pushes, and the merged export.

The policy is a PeftModel over the base model; its reference (beta > 0) is the same model with
the adapters disabled, so no second copy is held. A sync pushes the adapters only, named as
tandem.rollout.adapters says; a checkpoint holds them in PEFT's format.
"""

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.rollout.adapters import LORA_A, LORA_B
from tandem.trainer.config import ConfigError

ADAPTER = "default"  # PEFT's name for the one adapter a run trains


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("use_peft=True needs the peft package: pip install peft") from None
    return peft


def _matches(pattern: str, names: list[str]) -> bool:
    """PEFT's rule for a target given by name: the module's full name, or its last components."""
    return any(n == pattern or n.endswith("." + pattern) for n in names)


@dataclass(frozen=True)
class LoraOptions:
    """The adapters to train (TrainConfig's lora_* values)."""

    r: int
    alpha: int
    dropout: float
    target_modules: list[str] | None
    modules_to_save: list[str] | None
    model: str  # model_name_or_path, for the messages


def lora_config(options: LoraOptions, model: torch.nn.Module):
    """PEFT's LoraConfig from the run's options, after checking them against the model: a target
    that names no linear module, or a module to save that names none at all, fails here,
    naming the option and listing what the model has."""
    peft = _peft()
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    targets = options.target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    elif targets is not None:
        missing = [t for t in targets if not _matches(t, linear)]
        if missing:
            kinds = sorted({n.rsplit(".", 1)[-1] for n in linear})
            raise ConfigError(
                f"lora_target_modules={options.target_modules!r}: {missing} name no linear module of {options.model}; "
                f"its linear modules are {kinds} (or give all-linear)"
            )
    modules = [n for n, _ in model.named_modules() if n]
    missing = [m for m in options.modules_to_save or [] if not _matches(m, modules)]
    if missing:
        top = sorted({n.rsplit(".", 1)[-1] for n in modules if not n.split(".")[-1].isdigit()})
        raise ConfigError(f"lora_modules_to_save={options.modules_to_save!r}: {missing} name no module of {options.model}; its modules are {top}")
    if getattr(model.config, "tie_word_embeddings", False):
        embeddings = {n for n, m in model.named_modules() if m is model.get_input_embeddings() or m is model.get_output_embeddings()}
        for option, given in (("lora_target_modules", options.target_modules or []), ("lora_modules_to_save", options.modules_to_save or [])):
            tied = [m for m in given if m != "all-linear" and _matches(m, sorted(embeddings))]
            if tied:
                raise ConfigError(
                    f"{option}={given!r}: {tied} share one weight with {sorted(embeddings - set(tied)) or 'another module'} "
                    "(tie_word_embeddings): training it would untie them; leave it out"
                )
    return peft.LoraConfig(
        r=options.r,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules=targets,
        modules_to_save=options.modules_to_save,
        task_type="CAUSAL_LM",
    )


def adapt(options: LoraOptions, model: torch.nn.Module, resume_dir: Path | None) -> torch.nn.Module:
    """The base model with trainable adapters: new ones, or the checkpoint's when resuming. A model
    adapted already (the Python API's PeftModel) trains its own adapters, the checkpoint's
    weights loaded into them when resuming."""
    peft = _peft()
    if isinstance(model, peft.PeftModel):
        return _adapted(model, resume_dir)
    if resume_dir is not None:
        if not (resume_dir / "adapter_config.json").is_file():
            raise ConfigError(f"use_peft=True: checkpoint {resume_dir} holds a full model, not adapters; resume it with use_peft false")
        return load_adapters(model, resume_dir, trainable=True)
    with _quiet():
        return peft.get_peft_model(model, lora_config(options, model))


def _adapted(model, resume_dir: Path | None):
    from safetensors.torch import load_file

    if model.active_adapter != ADAPTER or type(model.peft_config[ADAPTER]).__name__ != "LoraConfig":
        raise ConfigError(f"model: a PeftModel with one LoRA adapter named {ADAPTER!r} is trained; it has {model.active_adapter!r} "
                          f"({type(model.peft_config[model.active_adapter]).__name__})")  # fmt: skip
    if resume_dir is not None:
        weights = resume_dir / "adapter_model.safetensors"
        if not weights.is_file():
            raise ConfigError(f"use_peft=True: checkpoint {resume_dir} holds a full model, not adapters; resume it with use_peft false")
        _peft().set_peft_model_state_dict(model, load_file(weights))
    for name, parameter in model.named_parameters():
        if ".lora_" in name or ".modules_to_save." in name:
            parameter.requires_grad_(True)
    return model


def load_adapters(model: torch.nn.Module, folder: Path, trainable: bool = False):
    """The base model with the adapters saved in `folder` (PEFT's format)."""
    with _quiet():
        return _peft().PeftModel.from_pretrained(model, folder, is_trainable=trainable)


@contextmanager
def _quiet():
    """PEFT asks transformers 5 a question under its deprecated name, once per model: not the user's concern."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def adapter_weights(model) -> list[tuple[str, torch.Tensor]]:
    """What a sync pushes: each adapted layer's lora_A and lora_B (scale folded into B) under its
    base weight's name, and each module trained whole (lora_modules_to_save) under its own names."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    out = []
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            weight = f"{name}.weight"
            out.append((weight + LORA_A, module.lora_A[ADAPTER].weight.detach()))
            out.append((weight + LORA_B, module.lora_B[ADAPTER].weight.detach() * module.scaling[ADAPTER]))
        elif isinstance(module, ModulesToSaveWrapper):
            out += [(f"{name}.{p}", t.detach()) for p, t in module.modules_to_save[ADAPTER].named_parameters()]
    return out


def base_weights(model) -> list[tuple[str, torch.Tensor]]:
    """The base model's weights under their own names (what a rollout server serves as its base)."""
    out = []
    for name, t in model.get_base_model().named_parameters():
        if ".lora_" in name or ".modules_to_save." in name:
            continue
        out.append((name.replace(".base_layer.", ".").replace(".original_module.", "."), t.detach()))
    return out


def from_checkpoint(checkpoint: Path):
    """A LoRA checkpoint's base model (its run's model_name_or_path, else PEFT's record of it)
    with the checkpoint's adapters."""
    import json

    import yaml
    from transformers import AutoModelForCausalLM

    if not (checkpoint / "adapter_config.json").is_file():
        raise ValueError(f"{checkpoint} holds no adapter_config.json: it is not a LoRA checkpoint (a full checkpoint loads as it is)")
    run_config = checkpoint / "config.yaml"
    if run_config.is_file():
        base = yaml.safe_load(run_config.read_text())["model_name_or_path"]
    else:
        base = json.loads((checkpoint / "adapter_config.json").read_text())["base_model_name_or_path"]
    return load_adapters(AutoModelForCausalLM.from_pretrained(base), checkpoint)


def export_merged(checkpoint: Path, out: Path) -> Path:
    """Write base + adapters of a LoRA checkpoint as one full model (and its tokenizer) to `out`."""
    from transformers import AutoTokenizer

    from_checkpoint(checkpoint).merge_and_unload().save_pretrained(out)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out)
    return out
