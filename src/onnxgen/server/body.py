"""A request body from the socket to JSON: its content type, size and read time, nesting, and text.

:func:`read_body` runs on the event loop (it only awaits the socket); :func:`parse_body` runs on the
preparation pool with the rest of the request's CPU work. Every failure is an :class:`ApiError` (4xx;
499 where the client went away before its body arrived).

A body must keep coming: no gap of more than :data:`BODY_IDLE_S` between its chunks, and after the
first :data:`BODY_GRACE_S` at least :data:`MIN_BODY_RATE` bytes a second on average, besides the total
:data:`BODY_TIMEOUT_S`. A client that trickles its body a byte a second is cut off (408) within
seconds, so slow uploads hold a reading slot only briefly.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from onnxgen.server.protocol import ApiError

MAX_BODY_BYTES = 8 * 1024 * 1024
BODY_TIMEOUT_S = 30.0  # for the whole body to arrive
BODY_IDLE_S = 5.0  # longest wait for the body's next chunk
BODY_GRACE_S = 2.0  # after this long, a body must arrive at MIN_BODY_RATE on average
MIN_BODY_RATE = 16 * 1024  # bytes a second
# arrays and objects a body may open, counted on its bytes before parsing: parsing (and collecting) a
# few hundred thousand tiny containers holds the interpreter for a third of a second; no request needs
# as many (4096 messages, 128 tools, a schema of thousands of properties stay far below)
MAX_JSON_CONTAINERS = 100_000
CLIENT_GONE = 499  # the status logged for a client that closed its connection mid-body (nginx's)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a lone surrogate can reach a JSON string


def _json_media_type(value: str) -> bool:
    return value.split(";", 1)[0].strip().lower() == "application/json"


async def read_body(request: Request) -> bytes:
    """The POST body, refused unless it is declared JSON (415: a browser sends a text/plain POST to any
    site without asking, so anything else would let web pages drive the server), within
    :data:`MAX_BODY_BYTES` (413) and complete within :data:`BODY_TIMEOUT_S` (408)."""
    content_type = request.headers.get("content-type", "")
    if not _json_media_type(content_type):
        raise ApiError(
            415,
            f"the request body must be sent as Content-Type: application/json (got {content_type or 'none'!r})",
        )
    too_large = ApiError(
        413, f"the request body is larger than {MAX_BODY_BYTES} bytes; send a smaller prompt"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    loop = asyncio.get_running_loop()
    start = loop.time()
    chunks = request.stream().__aiter__()
    while True:
        elapsed = loop.time() - start
        behind = max(BODY_GRACE_S, len(body) / MIN_BODY_RATE)  # when the average rate falls too low
        wait = min(BODY_IDLE_S, BODY_TIMEOUT_S - elapsed, behind - elapsed)
        try:
            if wait <= 0:
                raise asyncio.TimeoutError
            chunk = await asyncio.wait_for(chunks.__anext__(), wait)
        except StopAsyncIteration:
            return bytes(body)
        except ClientDisconnect as e:
            raise ApiError(CLIENT_GONE, "the client closed the connection before its body arrived") from e
        except asyncio.TimeoutError as e:  # not the builtin TimeoutError before Python 3.11
            raise ApiError(
                408,
                f"the request body arrived too slowly ({len(body)} bytes in {loop.time() - start:.1f} s): a "
                f"body must arrive within {BODY_TIMEOUT_S:.0f} s, with no pause over {BODY_IDLE_S:.0f} s "
                f"and at {MIN_BODY_RATE // 1024} KiB/s or more after the first {BODY_GRACE_S:.0f} s",
            ) from e
        body.extend(chunk)
        if len(body) > MAX_BODY_BYTES:
            raise too_large


def parse_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object: 400 for invalid JSON, nesting deeper than the parser takes, or text
    that is not Unicode (a lone surrogate escape such as ``\\ud800``, which no tokenizer can take), and
    one that opens more than :data:`MAX_JSON_CONTAINERS` arrays and objects (counted before parsing:
    brackets inside strings count too)."""
    containers = body.count(b"[") + body.count(b"{")
    if containers > MAX_JSON_CONTAINERS:
        raise ApiError(
            400,
            f"the request body opens {containers} JSON arrays and objects (bracket characters in its text "
            f"count too), more than the {MAX_JSON_CONTAINERS} any request needs; send fewer prompts, "
            "messages or tools per request",
        )
    try:
        value = json.loads(body)
    except RecursionError as e:
        raise ApiError(
            400, "the request body nests JSON arrays/objects too deeply to parse; flatten it"
        ) from e
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e}); send a JSON object") from e
    if not isinstance(value, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(body):
        _refuse_surrogates(value)
    return value


def _refuse_surrogates(value: Any) -> None:
    """Raise a 400 naming the first string (or key) that holds a lone UTF-16 surrogate."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                _check_text(f"{where}.{key}" if where else str(key), key)
                stack.append((f"{where}.{key}" if where else str(key), inner))
        elif isinstance(item, list):
            stack.extend((f"{where}.{i}", inner) for i, inner in enumerate(item))
        elif isinstance(item, str):
            _check_text(where, item)


def _check_text(where: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        # the path may hold the surrogate itself (a key): shown escaped, the error body must be UTF-8
        where = where.encode("utf-8", "backslashreplace").decode("utf-8")
        raise ApiError(
            400,
            f"{where} holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}) at character {e.start}: "
            "that is not a Unicode character; send valid text (a surrogate escape must be one of a pair)",
            param=where,
        ) from e
