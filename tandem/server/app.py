"""`tandem rollout`: the HTTP rollout server. Thin FastAPI routes over RolloutService."""

import argparse
import asyncio
import hmac
import importlib.util
import ipaddress
import json
import logging
import mmap
import os
import sys
import threading
from contextlib import asynccontextmanager

import torch
from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tandem.aio import in_own_thread
from tandem.server import openai_protocol as O
from tandem.server import protocol as P
from tandem.server.openai_serving import ModelNotFound, OpenAIServing
from tandem.server.sessions import UnknownSession
from tandem.server.options import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_REQUEST_BYTES, ENGINE_NAMES, api_key
from tandem.server.serving import (
    Busy, EngineFailure, HeldByAnotherRun, NotReady, OtherProcess, RolloutService, TooLarge, UnknownUpdate, VersionConflict,
)  # fmt: skip
from tandem.rollout.types import SamplingParams
from tandem.rollout.weights import cuda_device_id, cuda_views, delta_size, host_id, open_cuda, open_sealed_memfd, parse_safetensors

log = logging.getLogger("tandem")

# What each route may answer besides 200, for the OpenAPI schema: every error has an ErrorBody.
_AUTH = {401: "missing or wrong API key", 413: "body over the size limit", 408: "body not received in time"}
_BODY = {400: "a value the server cannot use", 422: "a malformed request"}
_ENGINE = {503: "the model is still loading"}


def _responses(*groups: dict[int, str]) -> dict:
    return {code: {"model": P.ErrorBody, "description": text} for group in groups for code, text in group.items()}


def _openai_responses(*groups: dict[int, str]) -> dict:
    """The /v1/ routes' errors, in OpenAI's shape."""
    return {code: {"model": O.ErrorResponse, "description": text} for group in groups for code, text in group.items()}


# A /v1/ generation's answer may also be server-sent events (stream: true).
# Each server-sent event: `data:` a JSON chunk, or [DONE] (OpenAPI tools read an event-stream's schema per event).
_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
_STREAMED = {200: {"content": {"text/event-stream": {"schema": _EVENT}}, "description": "the answer; with stream: true, as events"}}


class Guard:
    """ASGI middleware that runs before any body is read: the API key (401 on every route but
    /health), the body size (413, by Content-Length or as it streams in) and the time between
    body pieces (408, so a client that declares a body and stops sending cannot hold the
    connection for ever)."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int, max_chunk_bytes: int, body_timeout: float):
        self.app, self.api_key = app, api_key
        self.max_request, self.max_chunk, self.body_timeout = max_request_bytes, max_chunk_bytes, body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"] != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return await _error(send, 401, scope["path"], "missing or wrong 'Authorization: Bearer <api key>' header")
        chunk = scope["path"].startswith("/weights/") and scope["path"].endswith(("/chunk", "/delta"))  # a weight chunk, whole or delta
        limit = self.max_chunk if chunk else self.max_request
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _error(send, 413, scope["path"], f"request body larger than the limit of {limit} bytes")
        seen, started, dropped = 0, False, False

        async def drop(status: int, message: str) -> dict:
            """Answer here, then tell the app the client is gone: its own answer is discarded."""
            nonlocal dropped
            if not started:
                await _error(send, status, scope["path"], message, close=True)
            dropped = True
            scope["tandem.dropped"] = message
            return {"type": "http.disconnect"}

        async def guarded_receive():
            nonlocal seen
            try:
                async with asyncio.timeout(self.body_timeout):  # no task per message, unlike wait_for
                    message = await receive()
            except TimeoutError:
                # A cancelled receive() consumes nothing, so look once more: after this process was
                # stopped (SIGSTOP, a paused VM), its timer fires before the bytes that arrived
                # meanwhile are read, and the client is not the one who stalled.
                try:
                    async with asyncio.timeout(1.0):
                        message = await receive()
                except TimeoutError:
                    return await drop(408, f"no body data for {self.body_timeout:g}s (--body-timeout); the request is dropped")
            seen += len(message.get("body", b""))
            if seen > limit:
                return await drop(413, f"request body larger than the limit of {limit} bytes")
            return message

        async def guarded_send(message):
            nonlocal started
            if dropped:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, guarded_receive, guarded_send)


async def _error(send, status: int, path: str, message: str, close: bool = False):
    body = json.dumps(_error_body(path, message, status)).encode()
    headers = [(b"content-type", b"application/json")] + ([(b"connection", b"close")] if close else [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def build_app(
    service: RolloutService,
    model_name: str = "",
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    dtype: str = "float32",
    device: str = "cpu",
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    cuda_ipc: bool = False,
    served_model_name: str | None = None,
) -> FastAPI:
    """The server's app: Guard before every route, its errors as {"error": ...} bodies, and the
    routers over `service` (status, generation, weights, the run it serves). `cuda_ipc`: the
    engine on `device`, a GPU, takes weights a trainer on that GPU shares through CUDA IPC."""

    @asynccontextmanager
    async def lifespan(app):
        yield
        # Here, not after uvicorn's run(): on SIGTERM uvicorn re-raises the signal once it has
        # stopped, which ends the process before code after run() could release the engine.
        await run_in_threadpool(service.stop)

    app = FastAPI(title="tandem rollout server", version="1", lifespan=lifespan)
    app.add_middleware(Guard, api_key=api_key, max_request_bytes=max_request_bytes, max_chunk_bytes=max_chunk_bytes, body_timeout=body_timeout)
    _error_bodies(app)
    served = served_model_name or model_name.rstrip("/").rsplit("/", 1)[-1]
    app.state.openai = OpenAIServing(service, served, aliases={model_name})  # its tokenizer is set once the model has loaded
    info = P.Info(model=model_name, engine="loading", dtype=dtype, device=device, version=0, vocab_size=0, max_model_len=0, max_batch_tokens=0,
                  max_request_bytes=max_request_bytes, max_weight_chunk_bytes=max_chunk_bytes, host_id=host_id(), threads=0, stats={},
                  cuda_device=cuda_device_id(device) if cuda_ipc else None)  # fmt: skip
    gpu = torch.device(device) if info.cuda_device else None
    if gpu is not None and gpu.index is None:  # named with its index, as the engine's weights name their device
        gpu = torch.device("cuda", torch.cuda.current_device())
    for router in (_status_routes(service, info), _generation_routes(service), _weight_routes(service, gpu), _run_routes(service),
                   _openai_routes(app.state.openai)):  # fmt: skip
        app.include_router(router)
    return app


def _error_bodies(app: FastAPI) -> None:
    """Every error answers {"error": message}, with the status its kind calls for; under /v1/,
    OpenAI's {"error": {"message", "type", "param", "code"}}, and a request it cannot take is a
    400 there, as OpenAI answers."""
    errors = {NotReady: 503, Busy: 503, VersionConflict: 409, OtherProcess: 409, HeldByAnotherRun: 409, UnknownUpdate: 404, TooLarge: 413, ValueError: 400,
              EngineFailure: 500, ModelNotFound: 404, UnknownSession: 404}  # fmt: skip
    for exc_type, status in errors.items():
        app.add_exception_handler(exc_type, lambda request, exc, status=status: _error_response(request, str(exc).strip("'\""), status))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        where = [".".join(str(x) for x in e["loc"] if x != "body") for e in exc.errors()]
        problems = "; ".join(f"{w}: {e['msg'].removeprefix('Value error, ')}" if w else e["msg"].removeprefix("Value error, ")
                             for w, e in zip(where, exc.errors()))  # fmt: skip
        if "/v1/" in request.url.path:
            return _error_response(request, f"invalid request: {problems}", 400, param=next((w for w in where if w), None))
        return JSONResponse({"error": f"invalid request: {problems}"}, 422)

    @app.exception_handler(StarletteHTTPException)  # also FastAPI's own (a subclass), e.g. a body it could not read
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error_response(request, exc.detail, exc.status_code)

    @app.exception_handler(ClientDisconnect)
    async def disconnected(request: Request, exc: ClientDisconnect):
        why = request.scope.get("tandem.dropped", "client disconnected")
        log.warning("%s during %s %s; request dropped", why, request.method, request.url.path)
        return JSONResponse({"error": why}, 400)  # nobody is left to read it


def _error_response(request: Request, message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(request.url.path, message, status, param), status)


def _error_body(path: str, message: str, status: int, param: str | None = None) -> dict:
    """{"error": message}; under /v1/ OpenAI's shape, which its clients read."""
    if "/v1/" in path:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return {"error": message}


def _openai_routes(serving: OpenAIServing) -> APIRouter:
    """OpenAI's API, for agents written against it (openai_serving.py)."""
    router = APIRouter()

    answers = {**_openai_responses(_AUTH, {400: "a value the server cannot use, or a malformed request", 404: "another model than the one served"}, _ENGINE),
               **_STREAMED}  # fmt: skip

    @router.get("/v1/models", response_model=O.ModelList, responses=_openai_responses(_AUTH))
    async def models():
        return serving.models()

    @router.post("/v1/chat/completions", response_model=O.ChatCompletion, responses=answers)
    async def chat(req: O.ChatCompletionRequest):
        return _answered(req, await serving.chat(req), serving.chat_chunks)

    @router.post("/v1/completions", response_model=O.Completion, responses=answers)
    async def complete(req: O.CompletionRequest):
        return _answered(req, await serving.complete(req), serving.completion_chunks)

    @router.post("/v1/responses", response_model=O.Response, responses=answers)
    async def responses(req: O.ResponsesRequest):
        return _events(req, await serving.responses(req), serving.response_events)

    return router


def _answered(req, response, chunks):
    """The answer as it is, or with stream: true as server-sent events of its chunks."""
    if not req.stream:
        return response
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return StreamingResponse(chunks(response, include_usage), media_type="text/event-stream")


def _events(req, response, events):
    """A Responses API answer as it is, or with stream: true as its server-sent events."""
    return StreamingResponse(events(response), media_type="text/event-stream") if req.stream else response


def _status_routes(service: RolloutService, info: P.Info) -> APIRouter:
    """/health and /info. Cheap routes are `async def`: they run on the event loop, never queued
    behind requests that hold worker threads."""
    router = APIRouter()

    @router.get("/health", response_model=P.Health)
    async def health():
        return P.Health(status="ready" if service.ready else "loading", version=service.version, instance_id=service.instance_id)

    @router.get("/info", response_model=P.Info, responses=_responses(_AUTH))
    async def server_info():
        return info.model_copy(update={
            "engine": type(service.engine).__name__ if service.ready else "loading",
            "version": service.version,
            "vocab_size": service.vocab_size,
            "max_model_len": service.max_model_len,
            "max_batch_tokens": service.max_batch_tokens,
            "threads": service.engine.threads if service.ready else torch.get_num_threads(),
            "stats": dict(service.stats),
        })  # fmt: skip

    return router


def _generation_routes(service: RolloutService) -> APIRouter:
    router = APIRouter()

    @router.post(
        "/generate",
        response_model=P.GenerateResponse,
        responses=_responses(_AUTH, _BODY, _ENGINE, {409: "min_version not live within version_timeout, or instance_id names another process", 500: "the engine failed",
                                                    503: "still loading, or too many requests wait for a version"}),
    )  # fmt: skip
    async def generate(req: P.GenerateRequest):
        params = SamplingParams(**req.sampling.model_dump())
        results = await service.generate(req.prompts, req.n, params, req.seeds, req.min_version, req.version_timeout, req.instance_id)
        return P.GenerateResponse(
            completions=[
                P.CompletionOut(token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason, version=c.version) for c in results
            ]
        )

    return router


def _weight_routes(service: RolloutService, gpu: torch.device | None) -> APIRouter:
    """A weight update: begin, chunks over HTTP, sealed memfds or buffers on `gpu` (CUDA IPC), commit;
    and the fingerprint."""
    router = APIRouter()

    @router.post("/weights/begin", response_model=P.WeightUpdateHandle,
                 responses=_responses(_AUTH, _BODY, _ENGINE, {409: "not the next version, or another run holds the server"}))  # fmt: skip
    async def begin(req: P.WeightUpdateBegin):
        return P.WeightUpdateHandle(update_id=service.begin_update(req.version, req.force, req.num_tensors, req.adapter, req.run_id, req.delta_from, req.keep_base))

    binary = {
        "response_model": P.Staged,
        "responses": _responses(_AUTH, _BODY, _ENGINE, {404: "no such update", 411: "no Content-Length", 413: "more than the update can hold"}),
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
    }

    async def received(update_id: str, request: Request, stage) -> P.Staged:
        """A chunk's body handed to `stage` (in a thread of its own: aio.in_own_thread says why).
        The update and its room are checked before a byte of the body is read or allocated."""
        declared = request.headers.get("content-length")
        if declared is None:
            raise HTTPException(411, "a weight chunk needs a Content-Length header")
        nbytes = int(declared)  # Guard checked it is digits and within --max-weight-chunk-bytes
        with service.reserved(update_id, nbytes):
            body = await _read_body(request, nbytes)
            return P.Staged(staged=await in_own_thread(stage, body))

    @router.put("/weights/{update_id}/chunk", **binary)
    async def chunk(update_id: str, request: Request):
        return await received(update_id, request, lambda body: service.stage(update_id, parse_safetensors_or_400(body)))

    @router.put("/weights/{update_id}/delta", **binary)
    async def delta(update_id: str, request: Request):
        """A delta update's chunk: weights.compress_delta of XORs against the delta base."""

        def stage(body: bytearray) -> int:
            # The chunk's room becomes what it decompresses to (the weights it stages), reserved
            # before that is allocated; the compressed body counted while it was read.
            with service.reserved(update_id, max(0, delta_size(body) - len(body))):
                return service.stage_delta(update_id, body)

        return await received(update_id, request, stage)

    @router.post("/weights/{update_id}/file", response_model=P.Staged,
                 responses=_responses(_AUTH, _BODY, _ENGINE, {404: "no such update", 413: "more than the update can hold"}))  # fmt: skip
    async def from_file(update_id: str, req: P.WeightFile):
        return P.Staged(staged=await in_own_thread(_stage_file, service, update_id, req.path))

    @router.post("/weights/{update_id}/cuda", response_model=P.Staged,
                 responses=_responses(_AUTH, _BODY, _ENGINE, {404: "no such update", 413: "more than the update can hold"}))  # fmt: skip
    async def from_gpu(update_id: str, req: P.WeightBuffer):
        if gpu is None:
            raise ValueError("this server takes no weights through CUDA IPC (it runs on no GPU, or its engine is not tandem's): send them over http or shm")
        return P.Staged(staged=await in_own_thread(_stage_cuda, service, update_id, req, gpu))

    @router.post("/weights/{update_id}/commit", response_model=P.WeightCommitResult,
                 responses=_responses(_AUTH, _ENGINE, {400: "tensors missing", 404: "no such update", 409: "not the next version"}))  # fmt: skip
    async def commit(update_id: str, req: P.WeightCommit | None = None):
        version = await in_own_thread(service.commit, update_id, req and req.fingerprint)
        return P.WeightCommitResult(version=version, fingerprint=(req and req.fingerprint) or "")

    @router.get("/weights/fingerprint", response_model=P.Fingerprint, response_model_exclude_none=True, responses=_responses(_AUTH, _ENGINE))
    async def weights_fingerprint():
        return P.Fingerprint(**await in_own_thread(service.fingerprint))

    return router


def _run_routes(service: RolloutService) -> APIRouter:
    """The training run the server serves: claimed at a trainer's start, let go at its end."""
    router = APIRouter()

    @router.post("/run", response_model=P.RunHolder, responses=_responses(_AUTH, _BODY, {409: "another run holds the server"}))
    async def claim(req: P.RunClaim):
        hold = service.claim(req.run_id, req.name, req.threads)
        return P.RunHolder(run_id=hold.run_id, name=hold.name, since=hold.since, lease_seconds=service.run_lease)

    @router.delete("/run", responses=_responses(_AUTH))
    async def release(run_id: str | None = None):
        service.release(run_id)
        return {}

    return router


async def _read_body(request: Request, nbytes: int) -> bytearray:
    """The body, received straight into one buffer of its declared length (no join copy)."""
    buf, pos = bytearray(nbytes), 0
    async for piece in request.stream():
        if pos + len(piece) > nbytes:
            raise ValueError("the body is longer than its Content-Length")
        buf[pos : pos + len(piece)] = piece
        pos += len(piece)
    if pos != nbytes:
        raise ValueError(f"the body ended after {pos} of {nbytes} declared bytes")
    return buf


def _stage_file(service: RolloutService, update_id: str, path: str) -> int:
    """Stage weights from a sealed memfd of a process on this host, mapped in place (see
    weights.open_sealed_memfd): the kernel's seals keep a staged or committed version from being
    changed or truncated by anyone; no message quotes the file's contents."""
    mapped = open_sealed_memfd(path)
    with service.reserved(update_id, len(mapped)):
        return service.stage(update_id, parse_safetensors_or_400(mapped))


def _stage_cuda(service: RolloutService, update_id: str, req: P.WeightBuffer, gpu: torch.device) -> int:
    """Stage weights from a buffer a trainer on this GPU shares (weights.share_cuda): mapped,
    copied into this process's memory on the device, and let go."""
    with service.reserved(update_id, req.buffer.nbytes):
        try:
            shared = open_cuda(req.buffer.model_dump(), gpu)
        except RuntimeError as exc:
            raise ValueError(f"could not map the trainer's GPU buffer ({exc}); is the trainer on {gpu} of this host?") from None
        tensors = {name: t.clone() for name, t in cuda_views(shared, req.header).items()}
        torch.cuda.current_stream(gpu).synchronize()  # copied before the mapping goes
        return service.stage(update_id, tensors)


def parse_safetensors_or_400(body: bytearray | mmap.mmap):
    if not body:
        raise ValueError("empty weight chunk; send a safetensors-serialised dict of tensors")
    try:
        return parse_safetensors(body)
    except ValueError as exc:
        raise ValueError(f"weight chunk is not valid safetensors bytes: {exc}") from None


# ---------------------------------------------------------------- the process


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_transformers_engine(args: argparse.Namespace):
    """A TransformersEngine on --model, as the trainer would load it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.engines.engine import TransformersEngine, eos_token_ids

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    lm = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engine = TransformersEngine(lm, eos_token_ids(tokenizer, lm.generation_config, args.model), pad, keep_packed=True, tokenizer=tokenizer)
    vocab = lm.get_output_embeddings().weight.shape[0]
    return engine, vocab, int(getattr(lm.config, "max_position_embeddings", 4096))


def load_vllm_engine(args: argparse.Namespace):
    """A VLLMEngine on --model, with vLLM's own options."""
    from transformers import AutoTokenizer, GenerationConfig

    from tandem.engines.engine import eos_token_ids
    from tandem.engines.vllm_engine import VLLMEngine

    folder = args.model
    if not os.path.isdir(folder):  # a hub name: one download, shared with vLLM
        from huggingface_hub import snapshot_download

        folder = snapshot_download(args.model)
    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        generation = None
    eos = eos_token_ids(AutoTokenizer.from_pretrained(folder), generation, args.model)
    options = {
        name: getattr(args, name)
        for name in ("gpu_memory_utilization", "tensor_parallel_size", "max_model_len", "enable_prefix_caching", "enforce_eager", "kv_cache_memory_bytes")
        if getattr(args, name) is not None
    }
    if args.device == "cpu":
        # A prompt prefilled in chunks makes vLLM 0.32 rewind the request's seeded generator,
        # which CPU generators cannot do ("CPU Generator does not use offset"): the engine core
        # dies at the first large batch. Whole prompts per step avoid the rewind.
        options["enable_chunked_prefill"] = False
        if args.kv_cache_memory_bytes is None and args.gpu_memory_utilization is None:
            # vLLM's default claims 92% of the host's memory for the KV cache, and fails to start
            # when a trainer or anything else holds more than 8%. Size it for --max-batch-tokens.
            options["kv_cache_memory_bytes"] = kv_cache_bytes(folder, args.dtype, max(args.max_batch_tokens, args.max_model_len or 0))
        if (args.tensor_parallel_size or 1) == 1:
            # vLLM pins its CPU worker's threads to cores; give it the last of ours, as many as
            # --threads gave torch here (a trainer on this host sizes itself to the others).
            cores = sorted(os.sched_getaffinity(0))[-torch.get_num_threads() :]
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    engine = VLLMEngine(folder, eos, args.dtype, options, torch.get_num_threads())
    return engine, engine.vocab_size, engine.max_model_len


def kv_cache_bytes(folder: str, dtype: str, tokens: int) -> int:
    """Bytes of keys and values that `tokens` tokens take in the model at `folder`."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder).get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * getattr(torch, dtype).itemsize
    return per_token * tokens


ENGINES = {"transformers": load_transformers_engine, "vllm": load_vllm_engine}
assert sorted(ENGINES) == sorted(ENGINE_NAMES), "tandem.server.options lists the engines --engine offers"


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    try:
        args.api_key = api_key(args)
    except ValueError as exc:
        print(f"tandem rollout: {exc}", file=sys.stderr)
        return 2
    if not is_loopback(args.host) and not args.api_key and not args.insecure:
        print(
            f"tandem rollout: refusing to bind {args.host} without --api-key: anyone who can reach it could replace the "
            "model's weights. Give --api-key KEY (and the same key to the trainer), or --insecure to accept that.",
            file=sys.stderr,
        )
        return 2
    if args.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        print(
            "tandem rollout: --engine vllm needs vLLM. On a CPU machine: pip install 'tandem-rl[vllm]' (or ./setup.sh --vllm); "
            "on GPUs: pip install vllm. See the README's section on the vLLM engine.",
            file=sys.stderr,
        )
        return 2
    # Two processes that each start a thread per core fight over the cores and run several times
    # slower than either alone: on CPU the server takes half and reports it in /info, and a
    # trainer on the same host sizes itself to the rest.
    torch.set_num_threads(args.threads or (max(1, len(os.sched_getaffinity(0)) // 2) if args.device == "cpu" else torch.get_num_threads()))
    service = RolloutService(max_batch_tokens=args.max_batch_tokens, max_version_waiters=args.max_version_waiters, run_lease=args.run_lease,
                             fixed_threads=bool(args.threads))  # fmt: skip
    app = build_app(service, args.model, args.api_key, args.max_request_bytes, args.max_weight_chunk_bytes, args.dtype, args.device, args.body_timeout,
                    cuda_ipc=args.engine == "transformers", served_model_name=args.served_model_name)  # fmt: skip

    def load():
        try:
            engine, vocab, max_len = ENGINES[args.engine](args)
        except Exception as exc:  # noqa: BLE001 - reported, then the process exits non-zero
            print(f"tandem rollout: could not load {args.model}: {exc}", file=sys.stderr, flush=True)
            server.should_exit = True
            load_failed.set()
            return
        from transformers import AutoTokenizer

        app.state.openai.tokenizer = AutoTokenizer.from_pretrained(args.model)
        service.set_engine(engine, vocab, max_len)
        print(f"tandem rollout: {args.model} ready on http://{args.host}:{args.port} (version 0)", flush=True)

    load_failed = threading.Event()
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=30))
    threading.Thread(target=load, name="tandem-load", daemon=True).start()
    server.run()
    service.stop()
    return 1 if load_failed.is_set() else 0
