"""``/v1/completions`` and ``/v1/chat/completions``: a prepared request queued, then answered whole or
streamed as OpenAI chunks (bodies from :class:`~onnxgen.server.shapes.ResponseShape`)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from onnxgen.server.access import request_record
from onnxgen.server.protocol import usage
from onnxgen.server.security import api_key_of
from onnxgen.server.service import Service
from onnxgen.server.shapes import ResponseShape
from onnxgen.server.streaming import collect, sse_events

SSE_HEADERS = {"Cache-Control": "no-cache"}


async def completion(server: Service, request: Request, chat: bool) -> Response:
    """Answer one completions (``chat=False``) or chat completions request."""
    key = api_key_of(request.scope)
    prepared = await server.prepare(request, lambda body: server.preparer(body, chat, key))
    record = request_record(request)
    record.prompt, record.prompt_tokens = prepared.prompt_text, prepared.prompt_tokens
    req = prepared.request
    stream = server.submit(prepared)
    shape = ResponseShape(
        server.model_name,
        prepared.choices,
        prepared.plan,
        server.token_bytes,
        req.top_logprobs_count,
        req.return_token_ids,
    )
    if req.stream:
        events = sse_events(stream, shape, req.include_usage, record)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    done = await collect(stream, request)
    record.completion_tokens = sum(map(len, done.token_ids))
    failed = done.failure()
    if failed is not None:
        return failed
    use = usage(stream.prompt_tokens, record.completion_tokens, stream.handle.cached_tokens)
    return JSONResponse(shape.response(done.results(), use))
