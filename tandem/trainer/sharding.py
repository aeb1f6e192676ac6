"""Sharded training with torch's FSDP2 (`fully_shard`): parameters, gradients and optimizer state
split across the training processes, for models whose whole training state does not fit one.

Each decoder layer (the model's `_no_split_modules`, or fsdp_config's
transformer_layer_cls_to_wrap) is one unit and the whole LM the root, as accelerate's FSDP2
plugin wraps a transformers model; with bf16, the units compute in bf16 over fp32 shards
(MixedPrecisionPolicy with bf16 parameters, reductions and outputs, accelerate's mapping).
tandem calls `fully_shard` itself rather than through the plugin because the plugin does not
engage on a CPU: under torchrun with cpu=True accelerate wraps the model in DDP instead. So the
path the tests run on CPU is the path a GPU run takes.

Every forward of a sharded module is a collective (its units gather their parameters), so every
rank makes the same calls in the same order: micro-batches run in lockstep (batch.collate),
colocated generation steps until every rank is done (TransformersEngine's `all_done`), and full
weights are gathered one tensor at a time, on every rank, in the order of named_parameters.
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from tandem.rollout.weights import StagedWeights
from tandem.trainer.config import ConfigError, TrainConfig

SHARDED = "sharded"  # a checkpoint's torch.distributed.checkpoint folder: model and optimizer, one file per rank


@dataclass
class Plan:
    reshard_after_forward: bool  # full_shard: gather each unit for its forward and again for its backward
    layer_classes: list[str] | None  # class names of the units; None: the model's _no_split_modules


def plan(fsdp: str, options: dict) -> Plan | None:
    """The run's sharding, from fsdp and fsdp_config (its fsdp_ prefixes dropped); None for DDP."""
    if not fsdp:
        return None
    layers = options.get("transformer_layer_cls_to_wrap")
    return Plan(
        reshard_after_forward=options.get("reshard_after_forward", "shard_grad_op" not in fsdp.split()),
        layer_classes=[layers] if isinstance(layers, str) else layers,
    )


def from_accelerate_config(config: TrainConfig, env=os.environ) -> None:
    """Under `accelerate launch` with an FSDP config file (which sets FSDP_* variables), and no
    fsdp given: fsdp and fsdp_config as that file says, so the resolved config shows them."""
    if config.fsdp or env.get("ACCELERATE_USE_FSDP", "false").lower() not in ("true", "1"):
        return
    if env.get("FSDP_VERSION", "1") != "2":
        raise ConfigError(f"accelerate's config file asks for fsdp_version {env.get('FSDP_VERSION', '1')}: tandem shards with FSDP2; set fsdp_version: 2 in it")
    if env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
        raise ConfigError("accelerate's config file asks for fsdp_offload_params: tandem does not offload to the CPU yet; set it to false")
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() in ("true", "1", "full_shard")
    config.fsdp = "full_shard" if reshard else "shard_grad_op"
    layers = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
    if layers:
        config.fsdp_config = {"transformer_layer_cls_to_wrap": [c.strip() for c in layers.split(",")]}
    config.validate()


def init_single_process(device: torch.device) -> None:
    """A process group of one: FSDP needs one even when a single process trains."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)


def shard(model: torch.nn.Module, plan: Plan, bf16: bool, device: torch.device) -> torch.nn.Module:
    """`model` sharded in place: each decoder layer one FSDP unit, then the root. Parameters on
    the CPU move to `device` one unit at a time."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    classes = set(plan.layer_classes or getattr(model, "_no_split_modules", None) or [])
    units = [m for m in model.modules() if type(m).__name__ in classes]
    if not units:
        kinds = sorted({type(layer).__name__ for m in model.modules() if isinstance(m, torch.nn.ModuleList) for layer in m})
        raise ConfigError(
            f"fsdp_config transformer_layer_cls_to_wrap={sorted(classes) or None}: no module of {type(model).__name__} is of that class; "
            f"its layer classes are {kinds}"
        )
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    bf16_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16)
    kwargs = {"mesh": mesh, "reshard_after_forward": plan.reshard_after_forward, "mp_policy": bf16_policy if bf16 else MixedPrecisionPolicy()}
    for unit in units:
        fully_shard(unit, **kwargs)
    # The root (embeddings, final norm, output layer) stays gathered from its forward to its
    # backward, torch's default for a root: the output layer runs after the model's call
    # (head.py), on its gathered weight. Forwards without a backward reshard it themselves.
    fully_shard(model, **(kwargs | {"reshard_after_forward": False}))
    return model


def full_weights(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each weight gathered whole, one at a time. Every rank must run this to the end, in the
    same order: each gather is a collective."""
    for name, p in named:
        yield name, full_value(p.detach())


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor (a weight, or the gradient norm of DTensor gradients) whole, as a plain tensor."""
    tensor = sys.modules.get("torch.distributed.tensor")  # a run that never imported it holds no DTensor
    return t.full_tensor() if tensor is not None and isinstance(t, tensor.DTensor) else t


def stage(named: Iterable[tuple[str, torch.Tensor]], folder: Path, bucket_bytes: int, is_main: bool) -> StagedWeights | None:
    """What a push sends, from sharded weights: rank 0 writes them to `folder` a bucket of full
    tensors at a time, freeing each once written; the other ranks take part in the gathers."""
    gathered = full_weights(named)
    if is_main:
        return StagedWeights.write(gathered, folder, bucket_bytes)
    for _ in gathered:
        pass
    return None


class Pushes:
    """Rank 0's staged pushes on disk: the newest is the client's copy for a restarted server, so
    it stays until the next one is pushed; older ones are removed."""

    def __init__(self, output_dir: Path, bucket_bytes: int, is_main: bool):
        self.output_dir, self.bucket_bytes, self.is_main = Path(output_dir), bucket_bytes, is_main
        self.kept: list[StagedWeights] = []

    def stage(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> StagedWeights | None:
        """On every rank: `named` gathered and staged for the push of `version` (rank 0 gets it)."""
        if len(self.kept) == 2:  # the one before the last push: no client reads it any more
            self.kept.pop(0).remove()
        staged = stage(named, self.output_dir / f".push-v{version}", self.bucket_bytes, self.is_main)
        if staged is not None:
            self.kept.append(staged)
        return staged

    def close(self) -> None:
        for staged in self.kept:
            staged.remove()


def _dcp():
    """torch.distributed.checkpoint and its state_dict helpers, imported when a sharded checkpoint
    is written or read: at the top, importing them would cost every run a second, sharded or not."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as state_dict

    return dcp, state_dict


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, reference: torch.nn.Module | None) -> dict:
    """This rank's shards, as torch.distributed.checkpoint saves and loads them."""
    _, state_dict = _dcp()
    model_state, optimizer_state = state_dict.get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    if reference is not None:
        state["reference"] = state_dict.get_model_state_dict(reference)
    return state


def save_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, reference: torch.nn.Module | None = None) -> None:
    """Every rank writes its shards of the weights and of the optimizer state into folder/sharded,
    and of a moving reference model's weights (sync_ref_model) when given."""
    dcp, _ = _dcp()
    dcp.save(_state(model, optimizer, reference), checkpoint_id=folder / SHARDED)


def load_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, reference: torch.nn.Module | None = None) -> None:
    """The weights and optimizer state of a checkpoint written by save_checkpoint, into this rank's
    shards (and the reference's, when given)."""
    dcp, state_dict = _dcp()
    state = _state(model, optimizer, reference)
    dcp.load(state, checkpoint_id=folder / SHARDED)
    state_dict.set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if reference is not None:
        state_dict.set_model_state_dict(reference, state["reference"])


def is_sharded(checkpoint: Path) -> bool:
    return (Path(checkpoint) / SHARDED).is_dir()


def load_model(checkpoint: Path) -> torch.nn.Module:
    """A sharded checkpoint's model, whole, in this one process."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    checkpoint = Path(checkpoint)
    if not is_sharded(checkpoint):
        raise ValueError(f"{checkpoint} holds no {SHARDED}/ folder: it is not a sharded checkpoint (a DDP checkpoint is an HF model already)")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
    model.generation_config = GenerationConfig.from_pretrained(checkpoint)
    state = {"model": model.state_dict()}
    _dcp()[0].load(state, checkpoint_id=checkpoint / SHARDED, no_dist=True)
    model.load_state_dict(state["model"])
    return model


def export(checkpoint: Path, out: Path) -> Path:
    """A sharded checkpoint's weights as a plain HF model (and its tokenizer) in `out`, by one
    process holding the model once."""
    from transformers import AutoTokenizer

    load_model(checkpoint).save_pretrained(out)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out)
    return out
