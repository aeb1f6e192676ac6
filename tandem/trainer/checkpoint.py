"""Checkpoints written atomically: a crash mid-save never leaves a broken `latest`.

A checkpoint folder holds the model and tokenizer in HF format (loads with
AutoModelForCausalLM.from_pretrained; with use_peft, the adapters in PEFT's format, which
PeftModel.from_pretrained loads), config.yaml, trainer_state.json (step, policy version,
sampler position, next round), optimizer.pt and scheduler.pt, and per rank rng_state_{rank}.pt and
rounds_{rank}.json (rounds generated ahead of training in async mode). Everything is written into
a hidden temporary folder, fsynced, and renamed into place; only then does `latest` move.

A sharded run (fsdp) writes no model weights and no optimizer.pt: every rank writes its shards of
both into sharded/ (torch.distributed.checkpoint), beside the model's config.json; `tandem export`
turns that into an HF model.
"""

import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from tandem.trainer.config import ConfigError

LATEST = "latest"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def staging_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f".tmp-checkpoint-{step}"


def start(output_dir: str | Path, step: int) -> Path:
    """A fresh staging folder for checkpoint `step` (rank 0 calls this before the others write)."""
    tmp = staging_dir(output_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _fsync_tree(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def finish(output_dir: str | Path, step: int, save_total_limit: int | None = None) -> Path:
    """fsync the staging folder, rename it to checkpoint-{step}, move `latest`, prune old ones."""
    output_dir = Path(output_dir)
    tmp, final = staging_dir(output_dir, step), output_dir / f"checkpoint-{step}"
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write_text(output_dir / LATEST, final.name + "\n")
    if save_total_limit:
        done = sorted((int(m.group(1)), p) for p in output_dir.iterdir() if (m := _NAME.match(p.name)))
        for _, old in done[:-save_total_limit]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names, or None; a folder never renamed into place is never returned."""
    pointer = Path(output_dir) / LATEST
    if not pointer.is_file():
        return None
    path = Path(output_dir) / pointer.read_text().strip()
    return path if path.is_dir() else None


def resolve(spec: str, output_dir: str | Path) -> Path:
    """`latest` (in output_dir) or a checkpoint folder; a clear error when there is none."""
    path = latest_checkpoint(output_dir) if spec == "latest" else Path(spec)
    if path is None:
        raise FileNotFoundError(f"resume_from_checkpoint=latest: {output_dir} has no complete checkpoint (no '{LATEST}' file)")
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"resume_from_checkpoint={spec}: {path} is not a tandem checkpoint (no trainer_state.json)")
    return path


def check_resume(path: Path, state: dict, world: int, sharded: bool) -> None:
    """A sharded checkpoint resumes sharded, on as many processes as wrote it (each rank's shards,
    RNG state and rounds ahead are its own); a full one resumes unsharded."""
    if state.get("sharded", False) and not sharded:
        raise ConfigError(f"resume_from_checkpoint: {path} is sharded (written with fsdp); resume with the same --fsdp")
    if sharded and not state.get("sharded", False):
        raise ConfigError(f"resume_from_checkpoint: {path} was written without fsdp; resume it without fsdp, or start a sharded run from its model (--model_name_or_path {path})")
    saved = state.get("world_size", world)
    if sharded and saved != world:
        raise ConfigError(
            f"resume_from_checkpoint: {path} was written by {saved} processes, this run has {world}; resume on {saved} "
            f"(torchrun --nproc_per_node {saved}), or write it as a model with `tandem export {path} OUT` and start a new run from OUT"
        )


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
