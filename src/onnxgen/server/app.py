"""The OpenAI-compatible HTTP app: /health, /v1/models (and /v1/models/{id}), /v1/completions,
/v1/chat/completions, /v1/responses, /tokenize and /detokenize (also under /v1), /metrics.

Every error is an OpenAI-style ``{"error": {...}}`` body: 400 for invalid requests (including a prompt
longer than the context), 401 without the API key, 403 for a cross-origin page, 404 for an unknown model
or route, 408 for a body that does not arrive, 413 for an oversized body, 415 for a body that is not
declared JSON, 503 when the wait queue is full (and /health 503 while the model is not serving), 500
when the engine fails. The process and other requests go on.

The event loop only moves bytes: each request's body is parsed, validated, tokenized and compiled
(stop strings, constraints) on a small worker pool (:class:`~onnxgen.server.prepare.RequestPreparer`),
and the model runs on the scheduler's thread, so /health and running streams keep answering while a
huge request is prepared.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from onnxgen.api.store import ResponseStore
from onnxgen.chat.parsers import server_tool_parser
from onnxgen.errors import OnnxgenError
from onnxgen.generation.speculative import Speculative
from onnxgen.llm import LLM
from onnxgen.server.access import RequestLog
from onnxgen.server.body import read_body
from onnxgen.server.cache_scope import DEFAULT_CACHE_SCOPE
from onnxgen.server.metrics import ServerMetrics
from onnxgen.server.prepare import Prepared, RequestPreparer
from onnxgen.server.protocol import ApiError, error_body
from onnxgen.server.responses import create_response, stored_response
from onnxgen.server.routes_chat import completion
from onnxgen.server.routes_tokens import detokenize_body, tokenize_body
from onnxgen.server.scheduler import QueueFull, Scheduler, SchedulerConfig
from onnxgen.server.security import Guard, SecurityConfig
from onnxgen.server.streaming import RequestStream

T = TypeVar("T")

PREPARE_WORKERS = 2  # threads preparing requests (tokenizers and llguidance release the GIL)
BODIES_AT_ONCE = 8  # requests prepared at once; the others wait, read
READERS_AT_ONCE = 32  # requests whose body is read or waits to be prepared (bounds the bodies in memory)


class Server:
    """The routes' shared state, and the :class:`~onnxgen.server.service.Service` they use: :meth:`prepare`
    (a body to a prepared request, on the worker pool) and :meth:`submit` (queue it, get its deltas)."""

    def __init__(
        self,
        llm: LLM,
        config: SchedulerConfig,
        model_name: str,
        tool_parser: str | None = None,
        speculative: Speculative | None = None,
        cache_scope: str = DEFAULT_CACHE_SCOPE,
    ) -> None:
        if llm.tokenizer is None:
            raise OnnxgenError(
                f"{llm.package.root} has no tokenizer.json; the server needs the model's tokenizer beside model.onnx"
            )
        self.llm, self.tokenizer, self.config, self.model_name = llm, llm.tokenizer, config, model_name
        self.metrics = ServerMetrics(model_name, config.max_batch)
        if llm.prefix_cache is not None:
            self.metrics.watch_prefix_cache(llm.prefix_cache)
        self.scheduler = Scheduler(llm, config, self.metrics)
        self.preparer = RequestPreparer(
            llm, llm.tokenizer, config, model_name, tool_parser, speculative, cache_scope
        )
        self.store = ResponseStore()
        self.pool = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="onnxgen-prepare")
        self._bodies: asyncio.Semaphore | None = None  # made on the event loop
        self._readers: asyncio.Semaphore | None = None
        self.ready = False  # the scheduler runs: /health answers 200
        self.tool_parser = tool_parser
        self.tool_parser_source = "--tool-call-parser"

    def model_card(self) -> dict[str, Any]:
        """The served model as ``/v1/models`` lists it (vLLM's ``max_model_len`` and which tool-call parser
        replies are read with, and why, beside OpenAI's fields)."""
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "onnxgen",
            "max_model_len": self.config.max_model_len,
            "tool_call_parser": self.tool_parser,
            "tool_call_parser_source": self.tool_parser_source,
        }

    async def prepare(self, request: Request, work: Callable[[bytes], T]) -> T:
        """Read the body of ``request`` and run ``work`` on it on the worker pool: at most
        :data:`READERS_AT_ONCE` bodies are read or held at once, of which :data:`BODIES_AT_ONCE` are
        prepared; a slow upload holds a reading slot only (and briefly: :func:`read_body`), never one
        that requests whose body has arrived wait for."""
        if self._bodies is None or self._readers is None:
            self._bodies = asyncio.Semaphore(BODIES_AT_ONCE)
            self._readers = asyncio.Semaphore(READERS_AT_ONCE)
        async with self._readers:
            body = await read_body(request)
            async with self._bodies:
                return await asyncio.get_running_loop().run_in_executor(self.pool, work, body)

    def token_bytes(self, token_id: int) -> bytes:
        return self.llm.token_bytes(token_id)

    def submit(self, prepared: Prepared) -> RequestStream:
        """Queue ``prepared``; its deltas arrive on the returned stream (503 when the queue is full)."""
        stream = RequestStream(prepared.choices, prepared.prompt_tokens, self.scheduler.wake)
        try:
            self.scheduler.submit(prepared.jobs(stream.handle))
        except QueueFull as e:
            raise ApiError(503, str(e), "server_overloaded", code="queue_full") from e
        return stream


def create_app(
    llm: LLM,
    config: SchedulerConfig | None = None,
    model_name: str | None = None,
    security: SecurityConfig | None = None,
    *,
    log_prompts: bool = False,
    tool_parser: str | None = None,
    speculative: Speculative | None = None,
    prefix_cache_scope: str = DEFAULT_CACHE_SCOPE,
) -> FastAPI:
    """The FastAPI app serving ``llm``; its scheduler thread runs for the app's lifespan.

    ``security`` says who may call it (default: loopback only, no key, no cross-origin pages, no docs);
    ``log_prompts`` puts each request's prompt into its log line; ``tool_parser`` names the tool-call
    format (default: the one the chat template shows); ``speculative``: what requests draft with unless
    they say otherwise (their ``speculative`` field; docs/server.md); ``prefix_cache_scope``: which
    requests share cached prefixes (:mod:`onnxgen.server.cache_scope`).
    """
    config = config or SchedulerConfig()
    security = security or SecurityConfig()
    template = llm.tokenizer.chat_template if llm.tokenizer is not None else None
    parser, parser_source = server_tool_parser(tool_parser, template)  # an unknown name fails now
    server = Server(
        llm, config, model_name or llm.package.root.name, parser.name, speculative, prefix_cache_scope
    )
    server.tool_parser_source = parser_source

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.scheduler.start()
        server.ready = True
        yield
        server.ready = False
        server.scheduler.stop()
        server.pool.shutdown(wait=False, cancel_futures=True)

    docs = security.docs
    app = FastAPI(
        title="onnxgen",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url=None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.server = server
    _routes(app, server)
    # added innermost first: RequestLog sees every request, CORS answers preflights before the guard
    app.add_middleware(Guard, config=security)
    if security.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(security.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "x-api-key"],
            max_age=600,
        )
    app.add_middleware(RequestLog, metrics=server.metrics, log_prompts=log_prompts)
    return app


def _routes(app: FastAPI, server: Server) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {exc}", "server_error"), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not server.ready:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != server.model_name:
            raise ApiError(
                404,
                f"model {model_id!r} is not served here; this server serves {server.model_name!r}",
                "not_found_error",
                param="model",
                code="model_not_found",
            )
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion(server, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await completion(server, request, chat=True)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await create_response(server, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return stored_response(server, response_id)

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> Response:  # (the body is rendered on the pool too)
        return await server.prepare(request, lambda body: JSONResponse(tokenize_body(server.preparer, body)))

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request) -> Response:
        return await server.prepare(
            request, lambda body: JSONResponse(detokenize_body(server.preparer, body))
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
