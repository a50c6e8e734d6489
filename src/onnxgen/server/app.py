"""The OpenAI-compatible HTTP app: /health, /v1/models, /v1/completions, /v1/chat/completions, /metrics.

Every error is an OpenAI-style ``{"error": {...}}`` body: 400 for invalid requests (including a prompt
longer than the context), 404 for an unknown model or route, 413 for an oversized body, 503 when the
wait queue is full, 500 when the engine fails. The process and other requests go on.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from onnxgen.errors import OnnxgenError
from onnxgen.llm import LLM
from onnxgen.server.metrics import ServerMetrics
from onnxgen.server.prepare import COMPLETION_DEFAULT_MAX_TOKENS, chat_prompt, completion_prompts, make_jobs
from onnxgen.server.protocol import ChatCompletionRequest, CompletionRequest, ResponseShape, error_body, usage
from onnxgen.server.scheduler import QueueFull, Scheduler, SchedulerConfig
from onnxgen.server.streaming import RequestStream, collect, sse_events

MAX_BODY_BYTES = 8 * 1024 * 1024


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param: str | None = extra.get("param")
        self.code: str | None = extra.get("code")

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        body = error_body(self.message, self.kind, self.param, self.code)
        return JSONResponse(body, status_code=self.status, headers=headers)


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    errors = e.errors(include_url=False)
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(x) for x in err["loc"])
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    param = ".".join(str(x) for x in errors[0]["loc"]) if errors and errors[0]["loc"] else None
    return "invalid request: " + "; ".join(parts) + more, param


async def _read_json(request: Request) -> Any:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes; send a smaller prompt")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(
                413, f"the request body is larger than {MAX_BODY_BYTES} bytes; send a smaller prompt"
            )
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e}); send a JSON object") from e


class Server:
    """The routes' shared state: the model, its scheduler and metrics."""

    def __init__(self, llm: LLM, config: SchedulerConfig, model_name: str) -> None:
        if llm.tokenizer is None:
            raise OnnxgenError(
                f"{llm.package.root} has no tokenizer.json; the server needs the model's tokenizer beside model.onnx"
            )
        self.llm, self.tokenizer, self.config, self.model_name = llm, llm.tokenizer, config, model_name
        self.metrics = ServerMetrics()
        self.scheduler = Scheduler(llm, config, self.metrics)

    def _parse(self, body: Any, chat: bool) -> ChatCompletionRequest | CompletionRequest:
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            req = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
        except ValidationError as e:
            message, param = _validation_message(e)
            raise ApiError(400, message, param=param) from e
        refused = req.refuse_unsupported()
        if refused is not None:
            raise ApiError(400, refused[1], param=refused[0])
        if req.model is not None and req.model != self.model_name:
            raise ApiError(
                404,
                f"model {req.model!r} is not served here; use {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if req.n > self.config.max_batch:
            raise ApiError(
                400,
                f"n={req.n} exceeds this server's batch of {self.config.max_batch} rows; lower n",
                param="n",
            )
        return req

    async def handle(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            response = await self._handle(request, chat)
        except ApiError as e:
            response = e.response()
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    async def _handle(self, request: Request, chat: bool) -> Response:
        req = self._parse(await _read_json(request), chat)
        try:
            if isinstance(req, ChatCompletionRequest):
                prompts, max_tokens = [chat_prompt(self.llm, req)], req.max_new
            else:
                prompts = completion_prompts(self.llm, self.tokenizer, req)
                max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
            if len(prompts) > self.config.max_queue:
                raise ApiError(
                    400,
                    f"{len(prompts)} prompts exceed this server's queue of {self.config.max_queue}; split them",
                )
            stream = RequestStream(req.n * len(prompts), sum(map(len, prompts)), self.scheduler.wake)
            jobs = make_jobs(
                self.llm, self.tokenizer, req, prompts, max_tokens, self.config.max_model_len, stream.handle
            )
            self.scheduler.submit(jobs)
        except QueueFull as e:
            raise ApiError(503, str(e), "server_overloaded", code="queue_full") from e
        except (OnnxgenError, ValueError) as e:
            raise ApiError(400, str(e)) from e
        shape = ResponseShape(chat, self.model_name)
        if req.stream:
            events = sse_events(stream, shape, req.include_usage, req.return_token_ids)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        done = await collect(stream, request)
        if done.disconnected:
            return Response(status_code=499)
        if done.error is not None:
            raise ApiError(500, done.error, "server_error")
        use = usage(stream.prompt_tokens, sum(map(len, done.token_ids)))
        ids = done.token_ids if req.return_token_ids else None
        return JSONResponse(shape.response(["".join(t) for t in done.texts], done.reasons, use, ids))


def create_app(llm: LLM, config: SchedulerConfig | None = None, model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving ``llm``; its scheduler thread runs for the app's lifespan."""
    config = config or SchedulerConfig()
    server = Server(llm, config, model_name or llm.package.root.name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.scheduler.start()
        yield
        server.scheduler.stop()

    app = FastAPI(title="onnxgen", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    _routes(app, server)
    return app


def _routes(app: FastAPI, server: Server) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {exc}", "server_error"), status_code=500)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": server.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "onnxgen",
            "max_model_len": server.config.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.handle(request, chat=True)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
