"""The rank's OpenAI-compatible HTTP surface: FastAPI routes served by uvicorn in a thread.

    POST /e/<episode>/v1/chat/completions   messages, tools, n, max_tokens, logprobs
    POST /e/<episode>/v1/completions        prompt (text or token ids), n, max_tokens, logprobs
    POST /e/<episode>/v1/messages           Anthropic's Messages: system, messages, tools, max_tokens
    GET  /e/<episode>/v1/models, /v1/models the served model

An episode's base URL names it, so requests are attributed to their episode without the harness
saying so, and the key is the run's (`Authorization: Bearer <key>`, or Anthropic's `x-api-key`).
Errors have OpenAI's shape ({"error": {message, type, code}}), Anthropic's on its route ({"type":
"error", "error": {type, message}}), with the status codes both use, so either client raises its
usual exceptions. The routes only
parse and answer; what a request means (its tokens, the engine, the episode's limits) is the
gateway's (distflow.rollout.agents.gateway).
"""

from __future__ import annotations

import secrets
import socket
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from distflow.config import ConfigError

class ApiError(Exception):
    """A refused request: the HTTP status, OpenAI's error type and code, and the message."""

    def __init__(self, status: int, message: str, code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind


def _error(status: int, message: str, code: str | None, kind: str, anthropic: bool = False) -> JSONResponse:
    if anthropic:
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


def build_app(gateway, api_key: str):
    """The FastAPI application over `gateway` (chat, complete, messages, model_name), guarded by `api_key`."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    def authorised(request: Request) -> bool:
        return secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {api_key}") or \
            secrets.compare_digest(request.headers.get("x-api-key", ""), api_key)

    async def answer(request: Request, call, anthropic: bool = False):
        if not authorised(request):
            return _error(401, "missing or wrong API key (Authorization: Bearer <the episode's api_key>)",
                          "invalid_api_key", "authentication_error", anthropic)
        try:
            body = await request.json()
        except ValueError as e:
            return _error(400, f"the request body is not valid JSON: {e}", "invalid_json", "invalid_request_error",
                          anthropic)
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_json", "invalid_request_error",
                          anthropic)
        try:
            return await call(body)
        except ApiError as e:
            return _error(e.status, e.message, e.code, e.kind, anthropic)

    def models():
        return {"object": "list", "data": [{"id": gateway.model_name, "object": "model", "created": 0,
                                            "owned_by": "distflow"}]}

    @app.get("/v1/models")
    async def list_models(request: Request):
        return models() if authorised(request) else _error(401, "missing or wrong API key", "invalid_api_key",
                                                           "authentication_error")

    @app.get("/e/{episode}/v1/models")
    async def list_episode_models(episode: str, request: Request):
        return await list_models(request)

    @app.post("/e/{episode}/v1/chat/completions")
    async def chat(episode: str, request: Request):
        return await answer(request, lambda body: gateway.chat(episode, body))

    @app.post("/e/{episode}/v1/completions")
    async def complete(episode: str, request: Request):
        return await answer(request, lambda body: gateway.complete(episode, body))

    @app.post("/e/{episode}/v1/messages")
    async def messages(episode: str, request: Request):
        return await answer(request, lambda body: gateway.messages(episode, body), anthropic=True)

    return app


class Endpoint:
    """The app served on (host, port) by uvicorn in a daemon thread, from construction to `close`.
    A port that cannot be bound is a one-line ConfigError."""

    def __init__(self, app, host: str, port: int):
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise ConfigError(f"the agent endpoint cannot listen on {host}:{port} ({e.strerror or e}): choose another "
                              "agent.port (local rank r uses agent.port + r), or 0 for any free port") from None
        sock.listen(128)
        self.port = sock.getsockname()[1]
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        self.url = f"http://[{shown}]:{self.port}" if ":" in shown else f"http://{shown}:{self.port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="distflow-agent-endpoint")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint on {self.url} did not start")
            time.sleep(0.01)
        self.sock = sock

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
