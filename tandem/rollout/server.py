"""`tandem rollout`: the HTTP rollout server. Thin FastAPI routes over RolloutService."""

import argparse
import hmac
import ipaddress
import json
import mmap
import sys
import threading
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from tandem.rollout import protocol as P
from tandem.rollout.serving import NotReady, RolloutService, UnknownUpdate, VersionConflict
from tandem.rollout.types import SamplingParams
from tandem.rollout.weights import SHM_DIR, host_id, parse_safetensors

DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
DEFAULT_MAX_CHUNK_BYTES = 2 * 2**30


class BodyLimit:
    """ASGI middleware: 413 for a body over the limit, by Content-Length or as it streams in."""

    def __init__(self, app, max_request_bytes: int, max_chunk_bytes: int):
        self.app, self.max_request, self.max_chunk = app, max_request_bytes, max_chunk_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_chunk if scope["path"].endswith("/chunk") else self.max_request
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _reject(send, limit)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _TooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await _reject(send, limit)


class _TooLarge(Exception):
    pass


async def _reject(send, limit: int):
    body = json.dumps({"error": f"request body larger than the limit of {limit} bytes"}).encode()
    await send({"type": "http.response.start", "status": 413, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def build_app(
    service: RolloutService,
    model_name: str = "",
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    dtype: str = "float32",
    device: str = "cpu",
) -> FastAPI:
    app = FastAPI(title="tandem rollout server", version="1")
    app.add_middleware(BodyLimit, max_request_bytes=max_request_bytes, max_chunk_bytes=max_chunk_bytes)

    def authorised(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise HTTPException(401, "missing or wrong 'Authorization: Bearer <api key>' header")

    errors = {NotReady: 503, VersionConflict: 409, UnknownUpdate: 404, ValueError: 400}
    for exc_type, status in errors.items():
        app.add_exception_handler(exc_type, lambda request, exc, status=status: JSONResponse({"error": str(exc).strip("'\"")}, status))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(x) for x in e['loc'] if x != 'body')}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"error": f"invalid request: {problems}"}, 422)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return JSONResponse({"error": exc.detail}, exc.status_code)

    @app.get("/health", response_model=P.Health)
    def health():
        return P.Health(status="ready" if service.ready else "loading", version=service.version, instance_id=service.instance_id)

    @app.get("/info", response_model=P.Info, dependencies=[Depends(authorised)])
    def info():
        return P.Info(
            model=model_name,
            engine=type(service.engine).__name__ if service.ready else "loading",
            dtype=dtype,
            device=device,
            version=service.version,
            vocab_size=service.vocab_size,
            max_model_len=service.max_model_len,
            max_batch_tokens=service.max_batch_tokens,
            max_request_bytes=max_request_bytes,
            max_weight_chunk_bytes=max_chunk_bytes,
            host_id=host_id(),
            stats=dict(service.stats),
        )

    @app.post("/generate", response_model=P.GenerateResponse, dependencies=[Depends(authorised)])
    async def generate(req: P.GenerateRequest):
        params = SamplingParams(**req.sampling.model_dump())
        results = await run_in_threadpool(service.generate, req.prompts, req.n, params, req.seeds, req.min_version, req.version_timeout)
        return P.GenerateResponse(
            completions=[
                P.CompletionOut(token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason, version=c.version) for c in results
            ]
        )

    @app.post("/weights/begin", response_model=P.WeightUpdateHandle, dependencies=[Depends(authorised)])
    def begin(req: P.WeightUpdateBegin):
        return P.WeightUpdateHandle(update_id=service.begin_update(req.version, req.force, req.num_tensors))

    @app.put("/weights/{update_id}/chunk", dependencies=[Depends(authorised)])
    async def chunk(update_id: str, request: Request):
        tensors = parse_safetensors_or_400(await _read_body(request))
        return {"staged": await run_in_threadpool(service.stage, update_id, tensors)}

    @app.post("/weights/{update_id}/file", dependencies=[Depends(authorised)])
    def from_file(update_id: str, req: P.WeightFile):
        path = Path(req.path)
        if path.parent != SHM_DIR or not path.name.startswith("tandem-") or not path.is_file():
            raise ValueError(f"path must be a tandem-*.safetensors file directly in {SHM_DIR} on the server's host")
        with open(path, "rb") as fh:
            # A private mapping: the staged tensors view the file's pages in place, and stay valid
            # after the client deletes the file.
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        return {"staged": service.stage(update_id, parse_safetensors_or_400(mapped))}

    @app.post("/weights/{update_id}/commit", response_model=P.WeightCommitResult, dependencies=[Depends(authorised)])
    def commit(update_id: str):
        version = service.commit(update_id)
        return P.WeightCommitResult(version=version, fingerprint="")

    @app.get("/weights/fingerprint", response_model=P.Fingerprint, dependencies=[Depends(authorised)])
    def weights_fingerprint():
        version, fp = service.fingerprint()
        return P.Fingerprint(version=version, fingerprint=fp)

    return app


async def _read_body(request: Request) -> bytearray:
    """The body, received straight into one buffer when its length is declared (no join copy)."""
    declared = request.headers.get("content-length")
    if declared is None:
        buf = bytearray()
        async for piece in request.stream():
            buf += piece
        return buf
    buf, pos = bytearray(int(declared)), 0
    async for piece in request.stream():
        if pos + len(piece) > len(buf):
            raise ValueError("the body is longer than its Content-Length")
        buf[pos : pos + len(piece)] = piece
        pos += len(piece)
    if pos != len(buf):
        raise ValueError(f"the body ended after {pos} of {len(buf)} declared bytes")
    return buf


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


def load_engine(model: str, device: str, dtype: str):
    """A TransformersEngine on `model`, as the trainer would load it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.rollout.engine import TransformersEngine, eos_token_ids

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    tokenizer = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).to(device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engine = TransformersEngine(lm, eos_token_ids(tokenizer, lm, model), pad)
    vocab = lm.get_output_embeddings().weight.shape[0]
    return engine, vocab, int(getattr(lm.config, "max_position_embeddings", 4096))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model folder in HF format or hub name (the trainer's starting weights)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; anything but loopback needs --api-key (or --insecure)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="dtype the engine holds the weights in")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without --api-key (anyone who reaches the port can replace the weights)")
    p.add_argument("--max-batch-tokens", type=int, default=65536, help="most prompt + max_tokens tokens in one engine call")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, help="largest JSON request body")
    p.add_argument("--max-weight-chunk-bytes", type=int, default=DEFAULT_MAX_CHUNK_BYTES, help="largest weight chunk body")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    if not is_loopback(args.host) and not args.api_key and not args.insecure:
        print(
            f"tandem rollout: refusing to bind {args.host} without --api-key: anyone who can reach it could replace the "
            "model's weights. Give --api-key KEY (and the same key to the trainer), or --insecure to accept that.",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    service = RolloutService(max_batch_tokens=args.max_batch_tokens)
    app = build_app(service, args.model, args.api_key, args.max_request_bytes, args.max_weight_chunk_bytes, args.dtype, args.device)

    def load():
        try:
            engine, vocab, max_len = load_engine(args.model, args.device, args.dtype)
        except Exception as exc:  # noqa: BLE001 - reported, then the process exits non-zero
            print(f"tandem rollout: could not load {args.model}: {exc}", file=sys.stderr, flush=True)
            server.should_exit = True
            load_failed.set()
            return
        service.set_engine(engine, vocab, max_len)
        print(f"tandem rollout: {args.model} ready on http://{args.host}:{args.port} (version 0)", flush=True)

    load_failed = threading.Event()
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=30))
    threading.Thread(target=load, name="tandem-load", daemon=True).start()
    server.run()
    service.stop()
    return 1 if load_failed.is_set() else 0
