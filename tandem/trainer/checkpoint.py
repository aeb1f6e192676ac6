"""Checkpoints written atomically: a crash mid-save never leaves a broken `latest`.

A checkpoint folder holds the model and tokenizer in HF format (loads with
AutoModelForCausalLM.from_pretrained; with use_peft, the adapters in PEFT's format, which
PeftModel.from_pretrained loads), config.yaml, trainer_state.json (step, policy version,
sampler position, next round), optimizer.pt and scheduler.pt, and per rank rng_state_{rank}.pt and
rounds_{rank}.json (rounds generated ahead of training in async mode). Everything is written into
a hidden temporary folder, the marker checkpoint_complete.json last (every file and its size),
fsynced with its folders, and renamed into place; only then does `latest` move. Resume takes
only a checkpoint whose marker's files are all there, whole.

A sharded run (fsdp) writes no model weights and no optimizer.pt: every rank writes its shards of
both into sharded/ (torch.distributed.checkpoint), beside the model's config.json; `tandem export`
turns that into an HF model.
"""

import fcntl
import json
import os
import random
import re
import shutil
import socket
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import save_model

from tandem.trainer.config import ConfigError

LATEST = "latest"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def staging_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f".tmp-checkpoint-{step}"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (a full disk, a folder gone); `latest` did not move."""


def abandon(output_dir: str | Path, step: int) -> None:
    """Remove what a failed save staged (it holds nobody's state, and the disk may be full)."""
    shutil.rmtree(staging_dir(output_dir, step), ignore_errors=True)


def where_to_resume(output_dir: str | Path) -> str:
    """What to do after a stop that kept only the checkpoints already written: resume from the
    one `latest` names, or, with none, start again (a resume from none is refused)."""
    pointer = Path(output_dir) / LATEST
    if pointer.is_file():
        return f"latest still names {pointer.read_text().strip()}: resume with --resume_from_checkpoint latest --output_dir {Path(output_dir)}"
    return "there is no checkpoint yet: start the run again"


class RunFolderLock:
    """One trainer at a time in an output_dir: an exclusive lock on its .tandem.lock, held while
    the trainer lives (the kernel lets go of it when the process ends, however it ends). A second
    trainer there, a resume while the first still runs (the workers of a killed launcher, say),
    would interleave its logs and checkpoints with the first's."""

    NAME = ".tandem.lock"

    def __init__(self, output_dir: str | Path):
        check_writable(output_dir)
        path = Path(output_dir) / self.NAME
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            raise ConfigError(f"output_dir={output_dir} is in use by a trainer that still runs ({holder}): wait for it to end, or stop it "
                              "(the workers of a launcher that was killed end with it within seconds), then start or resume") from None  # fmt: skip
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the lock goes with its last descriptor
            self.fd = None


def check_writable(output_dir: str | Path) -> None:
    """output_dir is (or can be made) a folder this process can write, checked before anything
    loads: an unwritable one used to fail at the first log or save with an OSError."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir={path} is a file; give a folder for the run")
    probe = path / f".tandem-write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"output_dir={path}: cannot write there ({exc.strerror or exc}); choose a folder you can write to") from None


def start(output_dir: str | Path, step: int) -> Path:
    """A fresh staging folder for checkpoint `step` (rank 0 calls this before the others write)."""
    tmp = staging_dir(output_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


REFERENCE = "reference.safetensors"  # a moving reference model's weights (sync_ref_model), unsharded
MARKER = "checkpoint_complete.json"  # written last: the files of a whole checkpoint and their sizes


def _fsync_dir(path: Path) -> None:
    """A rename or a new file is durable only once its folder is fsynced (power loss, not SIGKILL)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    for d in [path, *(d for d in path.rglob("*") if d.is_dir())]:
        _fsync_dir(d)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _trash(path: Path) -> Path:
    return path.with_name(f".trash-{path.name}")


def incomplete(path: Path) -> str | None:
    """Why the checkpoint folder `path` cannot be resumed from, or None when it is whole: its
    marker names every file it was written with, and each must be there with its size."""
    marker = path / MARKER
    if not marker.is_file():
        return f"it has no {MARKER}: its save was cut short (or it is not a tandem checkpoint)"
    for name, size in json.loads(marker.read_text())["files"].items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
    return None


def finish(output_dir: str | Path, step: int, save_total_limit: int | None = None) -> Path:
    """Seal the staging folder (the marker, then fsync), put it in place as checkpoint-{step},
    move `latest`, prune old ones. A checkpoint-{step} already there (a resumed run saving the
    step again) goes to a trash folder first and is deleted last: at every moment `latest`
    names a whole checkpoint, or one whose previous copy resolve() puts back from the trash."""
    output_dir = Path(output_dir)
    tmp, final = staging_dir(output_dir, step), output_dir / f"checkpoint-{step}"
    files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
    _atomic_write_text(tmp / MARKER, json.dumps({"step": step, "files": files}, indent=1))
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(_trash(final), ignore_errors=True)
        os.replace(final, _trash(final))
        _fsync_dir(output_dir)
    os.replace(tmp, final)
    _fsync_dir(output_dir)
    _atomic_write_text(output_dir / LATEST, final.name + "\n")
    for trash in output_dir.glob(".trash-checkpoint-*"):  # this save's, or one a kill left behind
        if incomplete(output_dir / trash.name.removeprefix(".trash-")) is None:
            shutil.rmtree(trash, ignore_errors=True)
    if save_total_limit:
        done = sorted((int(m.group(1)), p) for p in output_dir.iterdir() if (m := _NAME.match(p.name)))
        for _, old in done[:-save_total_limit]:
            if old != final:  # renamed first: a kill mid-delete leaves no half checkpoint under its name
                os.replace(old, _trash(old))
                shutil.rmtree(_trash(old), ignore_errors=True)
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names if it is whole, or None. A save cut between its two renames
    left the previous copy of that checkpoint in its trash folder, whole: it is put back."""
    pointer = Path(output_dir) / LATEST
    if not pointer.is_file():
        return None
    path = Path(output_dir) / pointer.read_text().strip()
    if not path.exists() and _trash(path).is_dir() and incomplete(_trash(path)) is None:
        os.replace(_trash(path), path)
    return path if path.is_dir() and incomplete(path) is None else None


def resolve(spec: str, output_dir: str | Path) -> Path:
    """`latest` (in output_dir) or a checkpoint folder, whole; a clear error when there is none."""
    path = latest_checkpoint(output_dir) if spec == "latest" else Path(spec)
    if path is None:
        raise FileNotFoundError(f"resume_from_checkpoint=latest: {output_dir} has no complete checkpoint (no '{LATEST}' file, or it names a broken one)")
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"resume_from_checkpoint={spec}: {path} is not a tandem checkpoint (no trainer_state.json)")
    why = incomplete(path)
    if why is not None:
        raise FileNotFoundError(f"resume_from_checkpoint={spec}: {path} is not a complete checkpoint: {why}. Resume from another one")
    return path


RUN_FILES = ("metrics.jsonl", "completions.jsonl", "eval.jsonl", LATEST, "tandem")  # "tandem": TensorBoard's events


def run_in(output_dir: str | Path) -> tuple[list[str], bool]:
    """What in output_dir a run wrote (its logs, `latest`, its checkpoints), and whether that run
    trained: a step logged or a checkpoint. A run that stopped before its first step leaves
    empty logs (and a tracker's start), which are nobody's results."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return [], False
    found = sorted(p.name for p in output_dir.iterdir() if p.name in RUN_FILES or _NAME.match(p.name))
    metrics = output_dir / "metrics.jsonl"
    trained = any(n == LATEST or _NAME.match(n) for n in found) or (metrics.is_file() and metrics.stat().st_size > 0)
    return found, trained


def check_fresh(output_dir: str | Path, overwrite: bool, is_main: bool) -> None:
    """A run that does not resume starts in an output_dir holding no other run, so the two never
    mix (a log counting 1, 2, 3, 1, 2, ..., checkpoints replaced): refused unless `overwrite`.
    Rank 0 then deletes the other run's files, as it does those of a run that trained nothing."""
    found, trained = run_in(output_dir)
    if trained and not overwrite:
        raise ConfigError(
            f"output_dir={output_dir} holds a run ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}): resume it with "
            "--resume_from_checkpoint latest, start afresh there with --overwrite_output_dir true (its logs and checkpoints are "
            "deleted), or choose another output_dir"
        )
    if is_main:
        for name in found:
            path = Path(output_dir) / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def check_resume(path: Path, state: dict, world: int, sharded: bool) -> None:
    """A sharded checkpoint resumes sharded, on as many processes as wrote it (each rank's shards,
    RNG state and rounds ahead are its own); a full one resumes unsharded."""
    if state.get("sharded", False) and not sharded:
        raise ConfigError(f"resume_from_checkpoint: {path} is sharded (written with fsdp); resume with the same --fsdp")
    if sharded and not state.get("sharded", False):
        raise ConfigError(f"resume_from_checkpoint: {path} was written without fsdp; resume it without fsdp, or start a sharded run from its model (--model_name_or_path {path})")
    saved = state.get("world_size", world)
    if saved != world:  # each rank's RNG state and rounds generated ahead are its own
        new_run = f"`tandem export {path} OUT` and start a new run from OUT" if sharded else f"start a new run from its model (--model_name_or_path {path})"
        raise ConfigError(
            f"resume_from_checkpoint: {path} was written by {saved} processes, this run has {world}; resume on {saved} "
            f"(torchrun --nproc_per_node {saved}), or {new_run}"
        )


def rng_state() -> dict:
    """Every generator a step draws from: torch's CPU one, CUDA's of every device in use (LoRA
    dropout on a GPU draws there), numpy's and python's."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _torch_save(obj, path: Path) -> None:
    """torch.save, its failure to write the file (its zip writer raises a RuntimeError: "[enforce
    fail at inline_container.cc:...] file write failed") raised as the OSError it is."""
    try:
        torch.save(obj, path)
    except RuntimeError as exc:
        raise OSError(f"writing {path.name} failed: {str(exc).splitlines()[0]}") from None


class Checkpointer:
    """Saves the run's state at a round's end: TrainState, the learner's weights, optimizer and
    schedule, the producer's rounds generated ahead, every rank's RNG; and reads the per-rank
    parts back at resume. The run's files (tokenizer, resolved config) go into each checkpoint so
    it loads and resumes on its own."""

    def __init__(self, out: Path, dist, learner, producer, tokenizer, resolved_config: dict, save_total_limit: int | None, sharded: bool):
        self.out, self.dist, self.learner, self.producer, self.tokenizer = Path(out), dist, learner, producer, tokenizer
        self.resolved_config, self.save_total_limit, self.sharded = resolved_config, save_total_limit, sharded

    def save_collective(self, state) -> Path | None:
        """Every rank writes its part (its RNG state, the rounds it generated ahead, its shards);
        rank 0 the rest, then moves `latest`. A write that fails (a full disk) leaves no staging
        folder and `latest` where it was."""
        try:
            return self._save_collective(state)
        except (OSError, SafetensorError) as exc:
            abandon(self.out, state.step)
            raise CheckpointError(
                f"could not write checkpoint-{state.step} in {self.out} ({type(exc).__name__}: {exc}). Free some space there; {where_to_resume(self.out)}"
            ) from None
        except BaseException:
            abandon(self.out, state.step)  # whatever stopped it, no staging folder stays behind
            raise

    def _save_collective(self, state) -> Path | None:
        dist, lm = self.dist, self.learner.lm
        dist.barrier_collective("checkpoint: start")
        if dist.is_main:
            start(self.out, state.step)
        dist.barrier_collective("checkpoint: staging folder made")
        tmp = staging_dir(self.out, state.step)
        # Rounds generated ahead (async) are saved, not regenerated: they were made with weights
        # this checkpoint does not hold. Every rank keeps the same number so the sampler agrees.
        ahead = self.producer.pending(state.version)
        ahead = ahead[: int(dist.gather_collective(torch.tensor([len(ahead)]), "rounds ahead").min())]
        carried = self.producer.carried(state.version)  # partial rollouts: the sequences in flight, and the sampler past them
        # A write that fails on one rank fails the save on every rank, after all of them tried
        # theirs: none removes the staging folder while another still writes into it.
        self._written_collective("checkpoint: every rank's part written", lambda: self._write_rank_part(tmp, ahead, carried))
        moving_ref = self.learner.ref_model.lm if self.learner.ref_sync.every else None  # sync_ref_model: the reference is state too
        if self.sharded:  # every rank writes its shards; rank 0 the model's config
            from tandem.trainer.sharding import save_checkpoint

            dist.enter("checkpoint: shards")
            save_checkpoint(lm, self.learner.optimizer.optimizer, tmp, moving_ref)
        return self._written_collective("checkpoint: done", lambda: self._write_main_part(tmp, state, ahead, moving_ref) if dist.is_main else None)

    def _written_collective(self, what: str, write):
        return self.dist.together_collective(write, what, (OSError, SafetensorError),
                                             lambda: OSError("another training process could not write its part (its message says why)"))  # fmt: skip

    def _write_rank_part(self, tmp: Path, ahead: list, carried: dict | None) -> None:
        """This rank's files: its RNG state, the rounds it generated ahead, its sequences in flight."""
        rank = self.dist.rank
        _torch_save(rng_state(), tmp / f"rng_state_{rank}.pt")
        (tmp / f"rounds_{rank}.json").write_text(json.dumps([r.to_dict() for r in ahead]))
        if carried is not None:
            (tmp / f"in_flight_{rank}.json").write_text(json.dumps(carried))

    def _write_main_part(self, tmp: Path, state, ahead: list, moving_ref) -> Path:
        """Rank 0's files: the weights (unless sharded), optimizer, schedule, the run's files and
        TrainState; then the checkpoint is put in place and `latest` moved."""
        lm = self.learner.lm
        if self.sharded:  # the weights are in sharded/: the model's config says what they fill
            lm.config.save_pretrained(tmp)
            lm.generation_config.save_pretrained(tmp)
        else:
            lm.save_pretrained(tmp)
            _torch_save(self.learner.optimizer.state_dict(), tmp / "optimizer.pt")
            if moving_ref is not None:
                save_model(moving_ref, str(tmp / REFERENCE))  # tied weights stored once
        self.tokenizer.save_pretrained(tmp)
        (tmp / "config.yaml").write_text(yaml.safe_dump(self.resolved_config, sort_keys=False))
        saved = {
            "global_step": state.step,
            "skipped_steps": state.skipped_steps,
            "policy_version": state.version,
            "round": state.round,  # the next round to train
            "rounds_ahead": len(ahead),
            "world_size": self.dist.world,
            "sharded": self.sharded,
            "run_id": state.run_id,
            "sampler": ahead[-1].sampler_state if ahead else state.sampler,  # where generation goes on
            "entropy_bonus": self.learner.entropy.state_dict(),
        }
        (tmp / "trainer_state.json").write_text(json.dumps(saved, indent=1))
        _torch_save(self.learner.scheduler.state_dict(), tmp / "scheduler.pt")
        return finish(self.out, state.step, self.save_total_limit)

    def restore_rank(self, resume_dir: Path) -> tuple[list, dict | None]:
        """This rank's part of a checkpoint: its RNG state (set now), and for the producer the
        rounds it had generated ahead and the sequences it had in flight (partial rollouts)."""
        from tandem.trainer.producer import Round

        rounds_file = resume_dir / f"rounds_{self.dist.rank}.json"
        ready = [Round.from_dict(d) for d in json.loads(rounds_file.read_text())] if rounds_file.exists() else []
        in_flight = resume_dir / f"in_flight_{self.dist.rank}.json"
        carried = json.loads(in_flight.read_text()) if in_flight.exists() else None
        rng_file = resume_dir / f"rng_state_{self.dist.rank}.pt"
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, weights_only=False))  # our own file: numpy's state needs pickle
        return ready, carried
