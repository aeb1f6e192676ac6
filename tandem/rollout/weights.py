"""Moving trainer weights into an engine: fingerprints, buckets, safetensors, the shared-memory and
CUDA IPC paths, delta updates."""

import base64
import fcntl
import hashlib
import json
import math
import mmap
import os
import re
import shutil
import socket
import stat
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import zstandard
from safetensors import safe_open
from safetensors.torch import load_file, save_file

def fingerprint(named: Iterable[tuple[str, torch.Tensor]], ordered: bool = False) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order (`ordered`: they come in name
    order already, and are hashed as they come). Equal iff the weights are equal bit for bit (and
    held in the same dtype). StagedWeights are read one tensor at a time."""
    h = hashlib.sha256()
    for name, t in named if ordered else in_name_order(named):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def fingerprint_as(named, dtype: torch.dtype | None) -> str:
    """fingerprint() of `named` as a server holding `dtype` holds them (cast to it; None: as they
    are), a tensor at a time in name order."""
    return fingerprint(((n, t if dtype is None else t.to(dtype)) for n, t in in_name_order(named)), ordered=True)


def in_name_order(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) sorted by name; StagedWeights load each tensor only when it is reached."""
    return named.sorted() if isinstance(named, StagedWeights) else iter(sorted(named, key=lambda kv: kv[0]))


class StagedWeights:
    """Weights kept on disk, one safetensors file per bucket: what a trainer pushes when it holds
    no full copy of them (sharded training). The push reads one bucket at a time, and so does a
    restarted server's resync, so neither needs the whole set in memory."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.files = sorted(self.folder.glob("bucket-*.safetensors"))
        self._names = {}  # tensor name -> its file
        for f in self.files:
            with safe_open(f, "pt") as fh:
                self._names.update(dict.fromkeys(fh.keys(), f))

    @classmethod
    def write(cls, named: Iterable[tuple[str, torch.Tensor]], folder: Path, bucket_bytes: int) -> "StagedWeights":
        """Write `named` (consumed as it comes) into `folder` one bucket at a time, each bucket freed
        once written; what `folder` held before (a crashed run's staging) is replaced."""
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for i, bucket in enumerate(buckets(named, bucket_bytes)):
            save_file(bucket, str(tmp / f"bucket-{i:05d}.safetensors"))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        return cls(folder)

    def __len__(self) -> int:
        return len(self._names)

    def buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        for f in self.files:
            yield load_file(f)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets():
            yield from bucket.items()

    def sorted(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in sorted(self._names):
            with safe_open(self._names[name], "pt") as f:
                yield name, f.get_tensor(name)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None = None, keep_device: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """Group tensors into dicts of about bucket_bytes each (a tensor larger than that is alone),
    on the CPU; with `dtype`, sized as they will be when cast to it, and left where they are, as
    with `keep_device`."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in named:
        nbytes = t.numel() * (dtype or t.dtype).itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t.detach() if dtype is not None or keep_device else t.detach().contiguous().cpu()
        size += nbytes
    if bucket:
        yield bucket


# Float dtypes a weight may arrive in; it is cast to the engine's dtype when loaded. Integer,
# boolean and float64 tensors are refused: no trainer sends them, and a silent cast hides a bug.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_weights(params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], complete: bool) -> None:
    """Raise ValueError unless every tensor names a parameter of the same shape, holds a float
    dtype of WEIGHT_DTYPES and only finite values (and, when `complete`, every parameter is there)."""
    unknown = sorted(set(tensors) - set(params))
    missing = sorted(set(params) - set(tensors)) if complete else []
    if unknown or missing:
        raise ValueError(f"weights do not match the served model: unknown {unknown[:5]}, missing {missing[:5]}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(params[name].shape):
            raise ValueError(f"weight {name!r}: shape {tuple(t.shape)} does not match the model's {tuple(params[name].shape)}")
        check_values(name, t)


def check_values(name: str, t: torch.Tensor) -> None:
    """Raise ValueError unless t holds a float dtype of WEIGHT_DTYPES and only finite values."""
    if t.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight {name!r}: dtype {_DTYPES.get(t.dtype, t.dtype)} refused; send F32, BF16 or F16 (cast to the engine's dtype on load)")
    # A NaN or inf anywhere makes the sum non-finite: one cheap reduction (0.04 s for 2 GB
    # here, against 1.6 s for isfinite), and the exact check only when the sum overflowed.
    if not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
        raise ValueError(f"weight {name!r} holds NaN or inf values; the update is refused")


def max_update_bytes(params: dict[str, torch.Tensor]) -> int:
    """The most bytes a full update of these parameters can take in safetensors (F32, the widest
    accepted dtype, plus room for the header): the bound on what a client may make us allocate."""
    return sum(4 * p.numel() for p in params.values()) + 65536 + 512 * len(params)


def host_id() -> str:
    """Same for two processes on one host (and one boot): they can share memory (the shm transport)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()}:{boot}"


# Sealed memfds carry weights between processes of one host: the seals make the bytes immutable
# and the size fixed, enforced by the kernel, so a receiver can map them in place (no copy) and
# no process, the sender included, can change or truncate them afterwards.
SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE if hasattr(fcntl, "F_SEAL_WRITE") else 0
MEMFD_PATH = re.compile(r"/proc/(\d{1,10})/fd/(\d{1,10})")


def shm_available() -> bool:
    return hasattr(os, "memfd_create") and bool(SEALS)


def sealed_memfd(pieces: Iterable[memoryview]) -> int:
    """A memfd holding the pieces, sealed against any change; the caller closes the descriptor."""
    fd = os.memfd_create("tandem-weights", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        with os.fdopen(fd, "wb", closefd=False) as fh:
            for piece in pieces:
                fh.write(piece)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_sealed_memfd(path: str) -> mmap.mmap:
    """Map a sealed memfd named by /proc/<pid>/fd/<n>, refusing anything else: a regular file,
    a symbolic link to one, another user's descriptor, an unsealed memfd. The mapping is private
    (writes to it stay in this process) and the seals keep the bytes under it fixed."""
    if not MEMFD_PATH.fullmatch(path):
        raise ValueError("path must be /proc/<pid>/fd/<n>: a sealed memfd of a process of the server's user on this host")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"cannot open {path} ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise ValueError(f"{path} must be a memfd owned by the server's user")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0  # not a memfd: regular files cannot be sealed
        if seals & SEALS != SEALS:
            raise ValueError(f"{path} must be a memfd sealed against writes and resizing (F_SEAL_WRITE, F_SEAL_SHRINK, F_SEAL_GROW)")
        if info.st_size == 0:
            raise ValueError(f"{path} is empty; send a safetensors-serialised dict of tensors")
        return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- safetensors without extra copies
#
# The safetensors format (https://github.com/huggingface/safetensors#format): an 8-byte
# little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw
# bytes. safetensors.torch.save/load copy the whole payload once more on each side; streaming the
# tensors' own memory out and viewing the received buffer in place keeps a 2 GB push from
# spending most of its time in memcpy and page faults. Both sides stay readable by the
# safetensors library itself (the tests check both directions).

_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
_FROM_NAME = {v: k for k, v in _DTYPES.items()}
STREAM_PIECE = 16 * 2**20


def layout(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> tuple[dict, int, dict[str, torch.Tensor]]:
    """The safetensors header of `tensors` (in `dtype`, where given), the bytes of data it
    describes, and the tensors in the order their data follows."""
    def dtype_of(t: torch.Tensor) -> torch.dtype:
        return dtype or t.dtype

    # Widest dtypes first, as the safetensors library writes them: every tensor's offset is then
    # a multiple of its item size, which the parser requires.
    tensors = dict(sorted(tensors.items(), key=lambda kv: -dtype_of(kv[1]).itemsize))
    header, offset = {}, 0
    for name, t in tensors.items():
        if dtype_of(t) not in _DTYPES:
            raise ValueError(f"weight {name}: dtype {dtype_of(t)} cannot be sent")
        n = t.numel() * dtype_of(t).itemsize
        header[name] = {"dtype": _DTYPES[dtype_of(t)], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    return header, offset, tensors


def safetensors_stream(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> tuple[int, Iterator[memoryview]]:
    """(total bytes, pieces) of `tensors` in safetensors format; pieces point into the tensors,
    or with `dtype`, into each piece's copy in that dtype (cast a piece at a time, never whole)."""
    header, size, tensors = layout(tensors, dtype)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8-byte alignment
    prefix = len(head).to_bytes(8, "little") + head

    def pieces() -> Iterator[memoryview]:
        yield memoryview(prefix)
        for t in tensors.values():
            flat = t.detach().contiguous().reshape(-1)
            cast = dtype or t.dtype
            if cast == t.dtype and flat.device.type == "cpu":
                raw = memoryview(flat.view(torch.uint8).numpy())
                for lo in range(0, len(raw), STREAM_PIECE):
                    yield raw[lo : lo + STREAM_PIECE]
                continue
            step = max(1, STREAM_PIECE // cast.itemsize)
            for lo in range(0, len(flat), step):
                yield memoryview(flat[lo : lo + step].to("cpu", dtype=cast).view(torch.uint8).numpy())

    return len(prefix) + size, pieces()


MAX_HEADER_BYTES = 100 * 2**20  # the library's own limit


def parse_safetensors(buffer: bytearray | bytes) -> dict[str, torch.Tensor]:
    """Tensors viewing `buffer` in place (no copy). Raises ValueError on malformed input (see
    header_views). Messages never quote the buffer's contents."""
    if len(buffer) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(buffer[:8], "little")
    if n > len(buffer) - 8 or n > MAX_HEADER_BYTES:
        raise ValueError("header length points past the end of the data (or over 100 MiB)")
    try:
        header = json.loads(bytes(buffer[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ValueError("header is not valid UTF-8 JSON") from None
    base = 8 + n

    def view(start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.frombuffer(buffer, dtype=dtype, count=count, offset=base + start) if count else torch.empty(0, dtype=dtype)

    return header_views(header, len(buffer) - base, view)


def header_views(header, nbytes: int, view: Callable[[int, int, torch.dtype], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a safetensors header describes over `nbytes` of data, each made by
    view(start byte, element count, dtype). Raises ValueError unless the header describes
    tensors of known dtypes and non-negative shapes whose byte ranges are aligned, in order,
    without gaps or overlaps, and cover the data exactly."""
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    entries = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, start, end = _header_entry(name, spec)
        entries.append((start, end, name, dtype, shape))
    entries.sort(key=lambda e: e[:2])
    out, expected = {}, 0
    for start, end, name, dtype, shape in entries:
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = math.prod(shape)
        if start != expected or end - start != count * itemsize or start % itemsize:
            raise ValueError(f"tensor {name!r}: data_offsets overlap, leave a gap, are unaligned or do not fit its shape")
        expected = end
        out[name] = view(start, count, dtype).reshape(shape)
    if expected != nbytes:
        raise ValueError(f"the tensors cover {expected} bytes of data, but {nbytes} follow the header")
    return out


def _header_entry(name: str, spec) -> tuple[torch.dtype, list[int], int, int]:
    def ints(value, count: int | None) -> list[int]:
        ok = isinstance(value, list) and (count is None or len(value) == count)
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**48 for v in value)
        if not ok:
            raise ValueError(f"tensor {name!r}: shape and data_offsets must be lists of non-negative integers")
        return value

    if not isinstance(spec, dict) or spec.get("dtype") not in _FROM_NAME:
        raise ValueError(f"tensor {name!r}: header entry needs a dtype of {sorted(_FROM_NAME)}, a shape and data_offsets")
    start, end = ints(spec.get("data_offsets"), 2)
    return _FROM_NAME[spec["dtype"]], ints(spec.get("shape"), None), start, end


# ------------------------------------------------------------------ CUDA IPC
# A trainer and a server on one GPU share a push in device memory: the trainer copies each bucket
# into one buffer of its own, laid out as safetensors' data, and hands the server torch's own IPC
# handles for it (those torch.multiprocessing sends between processes), as JSON; the server maps
# the buffer, copies it into its own memory and lets it go. No byte crosses the host.


def cuda_device_id(device: torch.device | str) -> str | None:
    """The UUID of a CUDA device: equal for two processes on one GPU, whatever index each gives
    it. None for any other device."""
    device = torch.device(device)
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None


def cuda_bucket(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None, device: torch.device) -> tuple[torch.Tensor, dict]:
    """`tensors` (cast to `dtype`, where given) copied into one new uint8 buffer on `device`,
    and the safetensors header that describes it."""
    header, size, tensors = layout(tensors, dtype)
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    views = cuda_views(flat, header)
    for name, t in tensors.items():
        views[name].copy_(t.detach())
    return flat, header


def cuda_views(flat: torch.Tensor, header: dict) -> dict[str, torch.Tensor]:
    """The tensors `header` describes, viewing the uint8 buffer `flat` in place."""
    return header_views(header, flat.numel(), lambda start, count, dtype: flat.narrow(0, start, count * dtype.itemsize).view(dtype))


def share_cuda(flat: torch.Tensor) -> dict:
    """What another process on this GPU needs to map the uint8 buffer `flat` (open_cuda), as
    JSON. The sender keeps `flat` alive until the receiver has copied it; torch's reference
    counter keeps the memory from being reused while the receiver still maps it."""
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.current_stream(flat.device).synchronize()  # the copies into it are done before anyone reads it
    args = reduce_tensor(flat)[1]
    (_, _, _, offset, _, _, _, handle, storage_bytes, storage_offset, _, counter, counter_offset, event, event_sync) = args

    def text(raw: bytes | None) -> str | None:
        return None if raw is None else base64.b64encode(raw).decode()

    return {"handle": text(handle), "storage_bytes": storage_bytes, "storage_offset": storage_offset, "offset": offset, "nbytes": flat.numel(),
            "ref_counter": text(counter), "ref_counter_offset": counter_offset, "event": text(event), "event_sync": event_sync}  # fmt: skip


def open_cuda(shared: dict, device: torch.device) -> torch.Tensor:
    """The uint8 buffer share_cuda described, mapped from the process that shared it onto this
    process's `device` (the same GPU). Drop it once copied: the sender's memory stays held while
    any process maps it."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    def raw(text: str | None) -> bytes | None:
        return None if text is None else base64.b64decode(text)

    n, index = shared["nbytes"], torch.cuda.current_device() if device.index is None else device.index
    return rebuild_cuda_tensor(torch.Tensor, (n,), (1,), shared["offset"], torch.storage.TypedStorage, torch.uint8, index, raw(shared["handle"]),
                               shared["storage_bytes"], shared["storage_offset"], False, raw(shared["ref_counter"]), shared["ref_counter_offset"],
                               raw(shared["event"]), shared["event_sync"])  # fmt: skip


# ------------------------------------------------------------------ delta updates
# A delta update sends, for each weight, the XOR of its new and its previous bits in the dtype
# the server holds it in, compressed with zstd: between two optimizer steps most bf16 words do
# not change, and their XOR is zero. The server XORs what arrives into the weights it holds, and
# a fingerprint of the result, checked before the commit, proves it equals a full update.

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
DELTA_LEVEL = 1  # zstd's fastest level: a push's bytes are mostly zeros, which every level shrinks alike


def xor_bits(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """new ^ old over their bits, as integers of their item size (same dtype and shape)."""
    bits = _BITS[new.element_size()]
    return new.contiguous().view(bits) ^ old.contiguous().view(bits)


def apply_xor(base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The weight `delta` (xor_bits of it and `base`) was made from."""
    return (base.contiguous().view(delta.dtype) ^ delta).view(base.dtype)


def compress_delta(tensors: dict[str, torch.Tensor]) -> bytes:
    """zstd of the safetensors bytes of `tensors` (xor_bits results), with the content size in
    the frame's header: the server bounds what it decompresses by it before it allocates."""
    size, pieces = safetensors_stream(tensors)
    out = zstandard.ZstdCompressor(level=DELTA_LEVEL).compressobj(size=size)
    return b"".join([*(out.compress(piece) for piece in pieces), out.flush()])


def delta_size(body: bytes) -> int:
    """The bytes a compressed delta holds once decompressed, from its frame's header."""
    try:
        size = zstandard.frame_content_size(body)
    except zstandard.ZstdError as exc:
        raise ValueError(f"a delta chunk is not a zstd frame: {exc}") from None
    if size < 0:
        raise ValueError("a delta chunk's zstd frame does not say its content size; write it with the size (tandem does)")
    return size


def decompress_delta(body: bytes) -> dict[str, torch.Tensor]:
    """compress_delta's tensors back, decompressed straight into one buffer of the size the
    frame declares (delta_size), which they view."""
    out = bytearray(delta_size(body))
    try:
        got = zstandard.ZstdDecompressor().stream_reader(body).readinto(out)
    except zstandard.ZstdError as exc:
        raise ValueError(f"a delta chunk does not decompress: {exc}") from None
    if got != len(out):
        raise ValueError(f"a delta chunk decompresses to {got} bytes, its frame says {len(out)}")
    return parse_safetensors(out)
