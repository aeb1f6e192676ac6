"""Checkpoints in HF format, written atomically: a crash mid-save never leaves a broken `latest`."""

import json
import os
import shutil
from pathlib import Path

import yaml

LATEST = "latest"


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


def save_checkpoint(output_dir: str | Path, step: int, model, tokenizer, config: dict, state: dict) -> Path:
    """Write checkpoint-{step}/ (model, tokenizer, config.yaml, trainer_state.json) into a hidden
    temporary folder, fsync it, rename it into place, then move the `latest` pointer."""
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write_text(output_dir / LATEST, final.name + "\n")
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names, or None; a folder never renamed into place is never returned."""
    pointer = Path(output_dir) / LATEST
    if not pointer.is_file():
        return None
    path = Path(output_dir) / pointer.read_text().strip()
    return path if path.is_dir() else None
