"""The agents' endpoint: OpenAI's API inside sessions, served from the trainer's own process.

Every mode offers agents the same URL: a uvicorn server on loopback, in a thread of the trainer
process, whose requests become token ids for the round's engine (colocated, or the rollout
servers through the client, with the round's version floor). Sessions, seeds and version gates
stay with the trainer that owns the round; the rollout servers see token ids only. The routes
are the rollout server's /v1/ routes under /sessions/{id}: an agent's base URL is
`http://127.0.0.1:<port>/sessions/<id>/v1`, its API key the run's (a new random one per run).
"""

import secrets
import socket
import threading
import time

import uvicorn
from fastapi import APIRouter, FastAPI

from tandem.server import openai_protocol as O
from tandem.server.app import Guard, _answered, _error_bodies, _events, _openai_responses
from tandem.server.options import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES
from tandem.server.sessions import SessionServing

START_TIMEOUT = 30.0  # seconds the gateway may take to listen


def build_gateway_app(serving: SessionServing, api_key: str, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    app = FastAPI(title="tandem agent sessions", version="1")
    app.add_middleware(Guard, api_key=api_key, max_request_bytes=max_request_bytes, max_chunk_bytes=max_request_bytes, body_timeout=DEFAULT_BODY_TIMEOUT)
    _error_bodies(app)
    router = APIRouter(prefix="/sessions/{sid}/v1")
    answers = _openai_responses({401: "no or a wrong API key", 400: "a value the session cannot use, or one of its bounds reached",
                                 404: "no open session by that id"})  # fmt: skip

    @router.get("/models", response_model=O.ModelList, responses=answers)
    async def models(sid: str):
        serving.store.get(sid)
        return serving.models()

    @router.post("/chat/completions", response_model=O.ChatCompletion, responses=answers)
    async def chat(sid: str, req: O.ChatCompletionRequest):
        return _answered(req, await serving.session_chat(sid, req), serving.chat_chunks)

    @router.post("/completions", response_model=O.Completion, responses=answers)
    async def complete(sid: str, req: O.CompletionRequest):
        return _answered(req, await serving.session_complete(sid, req), serving.completion_chunks)

    @router.post("/responses", response_model=O.Response, responses=answers)
    async def responses(sid: str, req: O.ResponsesRequest):
        return _events(req, await serving.session_responses(sid, req), serving.response_events)

    app.include_router(router)
    return app


class Gateway:
    """build_gateway_app served on 127.0.0.1 (a free port) by a daemon thread, until close()."""

    def __init__(self, serving: SessionServing):
        self.serving, self.api_key = serving, secrets.token_urlsafe(24)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(build_gateway_app(serving, self.api_key), log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="tandem-agent-gateway", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agents' endpoint did not start listening on {self.url} within {START_TIMEOUT:g}s")
            time.sleep(0.01)

    def base_url(self, sid: str) -> str:
        return f"{self.url}/sessions/{sid}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5.0)
