"""How a push's weights reach the rollout servers: as safetensors over HTTP, through sealed
shared-memory files on this host, or through CUDA IPC on the trainer's own GPU. Each way is a
Transport, made once per push for the servers that take it; a transport whose memory the servers
read (the files, the GPU buffers) may hold the push's copy of the weights itself, so no second
copy is made."""

import logging
import mmap
import os
import threading
from typing import Callable, Iterator

import torch

from tandem.rollout.weights import (StagedWeights, buckets, cuda_bucket, cuda_views, parse_safetensors, safetensors_stream, sealed_memfd,
                                   share_cuda)  # fmt: skip

log = logging.getLogger("tandem")
# post(method, route, what, **request): one request of this update to one server, at
# /weights/{update id}/{route}; `what` names it in errors. Returns the answer.
Post = Callable[..., dict]
Named = list[tuple[str, torch.Tensor]] | StagedWeights


def bucketed(named: Named, bucket_bytes: int, keep_device: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """A push's buckets, on the CPU unless `keep_device`: StagedWeights as they were written, a
    bucket at a time."""
    return named.buckets() if isinstance(named, StagedWeights) else buckets(named, bucket_bytes, keep_device=keep_device)


def nbytes(bucket: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in bucket.values())


class Transport:
    """One push's way to the `users` servers that take it."""

    def __init__(self, users: int, device: torch.device):
        self.users, self.device = users, device

    def send(self, post: Post, url: str, named: Named, bucket_bytes: int) -> list[int]:
        """Stage every weight of `named` on the server at `url`; the bytes of each request."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class HttpChunks(Transport):
    """Each bucket as a safetensors body, streamed: the way to any server."""

    def send(self, post: Post, url: str, named: Named, bucket_bytes: int) -> list[int]:
        return [send_chunk(post, bucket) for bucket in bucketed(named, bucket_bytes)]


def send_chunk(post: Post, bucket: dict[str, torch.Tensor]) -> int:
    """One bucket as a safetensors body; its bytes."""
    post("PUT", "chunk", "a weight chunk", data=_Body(bucket), headers={"Content-Type": "application/octet-stream"})
    return nbytes(bucket)


class SharedFiles(Transport):
    """A push's buckets as sealed memfds, each written once for the `users` servers on this host
    that take it, not once per server, and closed once they all staged it, or once the push ended
    and no request that names it is in flight. A request to a server taken out mid-push may still
    be waiting there: its descriptor stays open until it ends, so the server, resumed, cannot open
    another file that reused the number. The server opens a descriptor through /proc and maps it;
    the seals make the bytes immutable, so nothing can change them once they are staged."""

    def __init__(self, users: int, device: torch.device):
        super().__init__(users, device)
        self._lock = threading.Lock()
        self._files: dict[int, list] = {}  # bucket index -> [descriptor, the servers that staged it, requests in flight]
        self._ended = False

    def copy(self, named: Named, dtype: torch.dtype | None, bucket_bytes: int) -> Named:
        """Write the push's buckets (cast to `dtype`) into their files now, a piece at a time, and
        return the weights as views of the files, in `named`'s order: the push's copy, in memory
        the servers map as well, with no second copy written (one gigabyte a push at the
        Qwen2.5-0.5B shape in bf16). buckets() of the views makes the same buckets again."""
        views: dict[str, torch.Tensor] = {}
        for i, bucket in enumerate(buckets(named, bucket_bytes, dtype)):
            self._files[i] = [sealed_memfd(safetensors_stream(bucket, dtype)[1]), set(), 0]
            views.update(parse_safetensors(mmap.mmap(self._files[i][0], 0, access=mmap.ACCESS_COPY)))
        return [(name, views[name]) for name, _ in named]

    def send(self, post: Post, url: str, named: Named, bucket_bytes: int) -> list[int]:
        sent = []
        for i, bucket in enumerate(bucketed(named, bucket_bytes)):
            try:
                fd = self._get(i, bucket)
            except OSError as exc:  # a file-size limit, or /dev/shm full: this bucket goes as a chunk
                _over_http(exc)
                sent.append(send_chunk(post, bucket))
                continue
            try:
                post("POST", "file", "a weight file", json={"path": f"/proc/{os.getpid()}/fd/{fd}"})
            finally:
                self._taken(i, url)
            sent.append(nbytes(bucket))
        return sent

    def _get(self, i: int, bucket: dict[str, torch.Tensor]) -> int:
        with self._lock:
            if i not in self._files:
                self._files[i] = [sealed_memfd(safetensors_stream(bucket)[1]), set(), 0]
            self._files[i][2] += 1
            return self._files[i][0]

    def _taken(self, i: int, url: str) -> None:
        with self._lock:
            entry = self._files[i]
            entry[1].add(url)
            entry[2] -= 1
            if entry[2] == 0 and (self._ended or len(entry[1]) >= self.users):
                os.close(entry[0])
                del self._files[i]

    def close(self) -> None:
        with self._lock:
            self._ended = True
            for i, (fd, _, flying) in list(self._files.items()):
                if flying == 0:
                    os.close(fd)
                    del self._files[i]


class CudaBuffers(Transport):
    """A push's buckets in buffers on the trainer's GPU, each made once for the servers on that
    GPU, which map them through CUDA IPC handles (weights.share_cuda) and copy them on the device.
    Where every server takes this way, the buffers are the push's copy (the servers' dtype, on the
    GPU: the model's size in device memory while the push is the last one)."""

    def __init__(self, users: int, device: torch.device):
        super().__init__(users, device)
        self._lock = threading.Lock()
        self._buffers: list[tuple[torch.Tensor, dict]] | None = None  # (uint8 buffer, its safetensors header) per bucket

    def copy(self, named: Named, dtype: torch.dtype | None, bucket_bytes: int) -> Named:
        """The push's copy of `named` (cast to `dtype`) in the buffers, as views of them in `named`'s order."""
        self._buffers = [cuda_bucket(b, dtype, self.device) for b in buckets(named, bucket_bytes, dtype, keep_device=True)]
        views = {name: t for flat, header in self._buffers for name, t in cuda_views(flat, header).items()}
        return [(name, views[name]) for name, _ in named]

    def send(self, post: Post, url: str, named: Named, bucket_bytes: int) -> list[int]:
        with self._lock:  # the copy is elsewhere (another transport's, or a resync's): buffers made once for the push's servers
            if self._buffers is None:
                self._buffers = [cuda_bucket(b, None, self.device) for b in bucketed(named, bucket_bytes, keep_device=True)]
        for flat, header in self._buffers:
            post("POST", "cuda", "a weight buffer", json={"header": header, "buffer": share_cuda(flat)})
        return [flat.numel() for flat, _ in self._buffers]


TRANSPORTS: dict[str, type[Transport]] = {"http": HttpChunks, "shm": SharedFiles, "cuda_ipc": CudaBuffers}


class Push:
    """One push's transports, by server: each kind made once, for the servers that take it."""

    def __init__(self, routes: dict[str, str], device: torch.device):
        self.kinds = {kind: TRANSPORTS[kind](sum(r == kind for r in routes.values()), device) for kind in set(routes.values())}
        self.by_url = {url: self.kinds[kind] for url, kind in routes.items()}

    def copy(self, named: Named, dtype: torch.dtype | None, bucket_bytes: int) -> Named:
        """The push's copy of `named`, in the servers' `dtype` where given: the weights a restarted
        server gets back, made in the GPU buffers where every server maps them, else in the shared
        files where any server maps them, else on the CPU."""
        cuda = self.kinds.get("cuda_ipc")
        if cuda is not None and cuda.users == len(self.by_url):
            return cuda.copy(named, dtype, bucket_bytes)
        if "shm" in self.kinds:
            try:
                return self.kinds["shm"].copy(named, dtype, bucket_bytes)
            except OSError as exc:  # a file-size limit, or /dev/shm full: the servers on this host get this push over HTTP
                _over_http(exc)
                self.kinds["shm"].close()
                self.kinds["http"] = self.kinds.get("http") or HttpChunks(0, self.kinds["shm"].device)
                self.by_url = {url: self.kinds["http"] if t is self.kinds["shm"] else t for url, t in self.by_url.items()}
                del self.kinds["shm"]
        return [(n, t.detach().to("cpu", dtype=dtype, copy=True).contiguous()) for n, t in named]

    def close(self) -> None:
        for transport in self.kinds.values():
            transport.close()


def _over_http(exc: OSError) -> None:
    log.warning(f"a weight push could not be written to shared memory ({type(exc).__name__}: {exc}); it goes over HTTP instead")


class _Body:
    """Tensors as a streamed safetensors body of known length: requests sends Content-Length, then
    the pieces. Each iteration streams them anew, so a retried request sends every byte again."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.length = safetensors_stream(tensors)[0]

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return safetensors_stream(self.tensors)[1]
