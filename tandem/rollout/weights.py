"""Moving trainer weights into an engine: fingerprints, buckets, the shared-memory path."""

import hashlib
import os
import socket
from pathlib import Path
from typing import Iterable, Iterator

import torch

SHM_DIR = Path("/dev/shm")


def fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order. Equal iff the weights are equal
    bit for bit (and held in the same dtype)."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Group tensors into dicts of about bucket_bytes each (a tensor larger than that is alone)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t.detach().contiguous().cpu()
        size += nbytes
    if bucket:
        yield bucket


def host_id() -> str:
    """Same for two processes on one host (and one boot): they can share /dev/shm."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()}:{boot}"


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)
