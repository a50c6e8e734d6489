"""``/v1/responses``: a Responses API request run as a chat request, answered as a response object or
streamed as the Responses event sequence.

The request's input items (after the conversation of ``previous_response_id``, from the bounded
:class:`~onnxgen.api.store.ResponseStore`) become chat messages and the request a
:class:`~onnxgen.server.protocol.ChatCompletionRequest`, which the chat path plans (tools, reasoning
split, ``text.format`` after the reasoning). Each generated token's text goes through the plan's parser
into an :class:`~onnxgen.api.responses_events.ResponseBuilder`, token by token whether the request
streams or not, so both give the same response. A finished response is stored (unless ``store`` is
false) with the conversation a later request continues.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from onnxgen.api.chat import TokenBytes, openai_logprob
from onnxgen.api.response_object import ResponseObject
from onnxgen.api.responses import ResponsesRequest
from onnxgen.api.responses_events import ResponseBuilder
from onnxgen.api.responses_input import chat_messages, conversation
from onnxgen.chat.plan import ChatPlan
from onnxgen.server.access import RequestRecord, request_record
from onnxgen.server.body import parse_body
from onnxgen.server.prepare import Prepared, count_messages_and_tools, validation_error
from onnxgen.server.protocol import MAX_MESSAGES, ApiError, ChatCompletionRequest
from onnxgen.server.security import api_key_of
from onnxgen.server.service import Service
from onnxgen.server.streaming import RequestStream, collect

log = logging.getLogger(__name__)


@dataclass
class ResponseRequest:
    """A prepared Responses request: the request, the conversation it continues, and the chat run."""

    request: ResponsesRequest
    history: list[dict[str, Any]]
    prepared: Prepared


def prepare_response(server: Service, body: bytes, api_key: int | None = None) -> ResponseRequest:
    """Validate a Responses body and prepare it as a chat request (on the preparation pool);
    ``api_key``: the index of the key the request used (it scopes the prefix cache)."""
    raw = parse_body(body)
    items = raw.get("input")
    if isinstance(items, list) and len(items) > MAX_MESSAGES:  # before validating them one by one
        raise ApiError(
            400, f"{len(items)} input items exceed this server's {MAX_MESSAGES} per request", param="input"
        )
    count_messages_and_tools({"tools": raw.get("tools")})
    try:
        req = ResponsesRequest.model_validate(raw)
    except ValidationError as e:
        raise validation_error(e) from e
    refused = req.refuse_unsupported()
    if refused is not None:
        raise ApiError(400, refused[1], param=refused[0])
    server.preparer.check_model(req.model)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = server.store.get(req.previous_response_id)
        if stored is None:
            raise ApiError(
                404,
                f"previous response {req.previous_response_id!r} is not stored here (unknown, evicted, or "
                "created with store=false); send the whole conversation as input instead",
                param="previous_response_id",
            )
        history = stored.messages
    chat = _chat_request(req, chat_messages(req, history))
    return ResponseRequest(req, history, server.preparer.chat(chat, api_key))


def _chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    fields: dict[str, Any] = {
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "tools": req.chat_tools() or None,
        "tool_choice": req.chat_tool_choice(),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "chat_template_kwargs": req.template_kwargs(),
        "response_format": req.response_format(),
        "logprobs": req.top_logprobs is not None,
        "top_logprobs": req.top_logprobs,
        "cache_salt": req.cache_salt,
    }
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            fields[name] = float(getattr(req, name))
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise validation_error(e) from e


class ResponseRun:
    """The output items and events of one response as its tokens arrive."""

    def __init__(
        self,
        ready: ResponseRequest,
        model: str,
        token_bytes: TokenBytes,
        cached_tokens: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.ready = ready
        self.cached_tokens = cached_tokens  # prompt tokens the prefix cache resumed (known once prefilled)
        plan = ready.prepared.plan
        if plan is None:  # a chat request always has a plan
            raise TypeError("a Responses request is prepared as a chat request")
        self.plan: ChatPlan = plan
        self.parser = plan.stream(hold_calls=True)
        self.token_bytes = token_bytes
        self.builder = ResponseBuilder(ResponseObject.for_request(ready.request, model))
        self.tokens = 0
        self.reasoning_tokens = 0

    @property
    def response(self) -> ResponseObject:
        return self.builder.response

    def start(self) -> list[dict[str, Any]]:
        return self.builder.start()

    def token(self, text: str, logprob: Any, reason: str | None) -> list[dict[str, Any]]:
        """The events of one generated token (and, with its finish ``reason``, of the response's end)."""
        self.tokens += 1
        parts = self.parser.feed(text, final=reason is not None)
        if any(part.reasoning for part in parts):
            self.reasoning_tokens += 1
        scores = [openai_logprob(logprob, self.token_bytes)] if logprob is not None else []
        events = self.builder.feed(parts, scores)
        if reason is not None:
            reason = self.plan.finish_reason(reason, self.parser.output)
            prompt = self.ready.prepared.prompt_tokens
            cached = self.cached_tokens() or 0
            events += self.builder.finish(reason, prompt, self.tokens, self.reasoning_tokens, cached)
        return events

    def body(self) -> dict[str, Any]:
        return self.response.model_dump(mode="json")


def _store(server: Service, run: ResponseRun) -> None:
    req = run.ready.request
    if req.store and run.response.status in ("completed", "incomplete"):
        messages = conversation(req, run.ready.history, run.response)
        server.store.put(run.response.id, run.body(), messages)


async def create_response(server: Service, request: Request) -> Response:
    """``POST /v1/responses``."""
    key = api_key_of(request.scope)
    ready = await server.prepare(request, lambda body: prepare_response(server, body, key))
    record = request_record(request)
    record.prompt, record.prompt_tokens = ready.prepared.prompt_text, ready.prepared.prompt_tokens
    stream = server.submit(ready.prepared)
    run = ResponseRun(ready, server.model_name, server.token_bytes, lambda: stream.handle.cached_tokens)
    if ready.request.stream:
        events = _events(server, stream, run, record)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    done = await collect(stream, request)
    record.completion_tokens = len(done.token_ids[0])
    failed = done.failure()
    if failed is not None:
        return failed
    run.start()
    scores = done.scores[0]
    for i, text in enumerate(done.texts[0]):
        last = i == len(done.texts[0]) - 1
        run.token(text, scores[i] if scores else None, done.reasons[0] if last else None)
    _store(server, run)
    return JSONResponse(run.body())


def _event(event: dict[str, Any]) -> str:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


async def _events(
    server: Service, stream: RequestStream, run: ResponseRun, record: RequestRecord
) -> AsyncIterator[str]:
    finished = False
    try:
        for event in run.start():
            yield _event(event)
        while not finished:
            item = await stream.next()
            if isinstance(item, str):  # DISCONNECTED
                return
            for delta in item:
                if delta.error is not None:
                    code = "invalid_request" if delta.client_error else "server_error"
                    for event in run.builder.fail(delta.error, code):
                        yield _event(event)
                    finished = True
                    return
                record.completion_tokens += 1
                for event in run.token(delta.text, delta.logprob, delta.finish_reason):
                    yield _event(event)
                finished = delta.finish_reason is not None
        _store(server, run)
    except Exception as e:  # a bug here must not end the stream without a word
        log.exception("streaming a response failed")
        for event in run.builder.fail(f"internal error while streaming: {e}"):
            yield _event(event)
    finally:
        if not finished:
            stream.cancel()


def stored_response(server: Service, response_id: str) -> dict[str, Any]:
    """``GET /v1/responses/{id}``: a stored response object."""
    stored = server.store.get(response_id)
    if stored is None:
        raise ApiError(404, f"response {response_id!r} is not stored here", param="response_id")
    return stored.response
