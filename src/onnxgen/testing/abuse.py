"""Requests that a careless or hostile client sends to ``onnxgen serve``, each with the 4xx it must get.

Used by the server tests and by ``scripts/abuse.py`` (which replays them against a live server and
watches its memory). Each :class:`Abuse` is the exact bytes and headers sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

JSON = {"content-type": "application/json"}
EIGHT_MIB_PROMPT = "ab " * 2_700_000  # 8.1 MB of text: under the body limit, far over any context


@dataclass(frozen=True)
class Abuse:
    """One bad request: what is sent, the status it must get and a phrase its error message holds."""

    name: str
    path: str
    body: bytes
    status: int
    says: str
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    method: str = "POST"


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def catalogue(model: str, max_batch: int, max_queue: int) -> list[Abuse]:
    """The bad requests for a server of ``model`` with ``--max-batch`` and ``--max-queue`` as given."""
    ok = {"model": model, "prompt": "def f():", "max_tokens": 8}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    many_optional = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(500)}}
    completions, chats = "/v1/completions", "/v1/chat/completions"
    return [
        Abuse("lone surrogate", completions, b'{"prompt": "\\ud800abc", "max_tokens": 4}', 400, "surrogate"),
        Abuse("lone surrogate in a key", completions, b'{"prompt": "abc", "\\ud800": 1}', 400, "surrogate"),
        Abuse(
            "lone surrogate in a nested key",
            chats,
            b'{"messages": [{"role": "user", "content": "a", "\\udc00x": {"\\ud801": 2}}]}',
            400,
            "surrogate",
        ),
        Abuse("temperature 1e-300", completions, _json({**ok, "temperature": 1e-300}), 400, "temperature"),
        Abuse("temperature 5e-324", chats, _json({**chat, "temperature": 5e-324}), 400, "temperature"),
        Abuse(
            "repetition_penalty 1e-308",
            completions,
            _json({**ok, "repetition_penalty": 1e-308}),
            400,
            "repetition_penalty",
        ),
        Abuse(
            "lone surrogate in chat",
            chats,
            b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}',
            400,
            "surrogate",
        ),
        Abuse(
            "JSON nested 100k deep",
            completions,
            b'{"prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            400,
            "arrays and objects",
        ),
        Abuse(
            "JSON nested 5000 deep",
            completions,
            b'{"prompt":' + b"[" * 5000 + b"]" * 5000 + b"}",
            400,
            "nests",
        ),
        Abuse(
            "500 optional properties, extra ones allowed",
            chats,
            _json({**chat, "response_format": _schema(many_optional), "json_extra_properties": True}),
            400,
            "too many alternatives",
        ),
        Abuse(
            "self-referencing schema",
            chats,
            _json({**chat, "response_format": _schema({"$ref": "#"})}),
            400,
            "no finite output",
        ),
        Abuse(
            "schema nested 900 deep",
            chats,
            _json({**chat, "response_format": _schema(_deep_schema(900))}),
            400,
            "json_schema",
        ),
        Abuse(
            "a 1M-character stop string",
            completions,
            _json({**ok, "stop": "x" * 1_000_000}),
            400,
            "stop string",
        ),
        Abuse(
            "16 stops of 1000 characters, n prompts x n choices",
            completions,
            _json({**ok, "prompt": ["a"] * max_queue, "n": max_batch, "stop": ["x" * 1000] * 16}),
            400,
            "stop string",
        ),
        Abuse(
            "17 stop strings",
            completions,
            _json({**ok, "stop": [f"s{i}" for i in range(17)]}),
            400,
            "stop strings",
        ),
        Abuse("8 MiB prompt", completions, _json({**ok, "prompt": EIGHT_MIB_PROMPT}), 400, "context holds"),
        Abuse(
            "8 MiB chat message",
            chats,
            _json({**chat, "messages": [{"role": "user", "content": EIGHT_MIB_PROMPT}]}),
            400,
            "context holds",
        ),
        Abuse(
            "too many messages",
            chats,
            _json({**chat, "messages": [{"role": "user", "content": ""}] * 200_000}),
            400,
            "messages",  # (refused by its count of objects, before parsing)
        ),
        Abuse("too many prompts", completions, _json({**ok, "prompt": [[1]] * 500_000}), 400, "prompts"),
        Abuse("body over 8 MiB", completions, b'{"prompt": "' + b"x" * (9 << 20) + b'"}', 413, "larger than"),
        Abuse(
            "text/plain POST (any web page can send one)",
            completions,
            _json(ok),
            415,
            "application/json",
            {"content-type": "text/plain"},
        ),
        Abuse("no content type", completions, _json(ok), 415, "application/json", {}),
        Abuse("DNS rebinding Host", completions, _json(ok), 400, "Host", {**JSON, "host": "evil.example"}),
        Abuse(
            "cross-origin page",
            completions,
            _json(ok),
            403,
            "cross-origin",
            {**JSON, "origin": "http://evil.example"},
        ),
        Abuse(
            "cross-origin preflight",
            completions,
            b"",
            403,
            "cross-origin",
            {"origin": "http://evil.example", "access-control-request-method": "POST"},
            "OPTIONS",
        ),
        Abuse("docs are off", "/openapi.json", b"", 404, "Not Found", {}, "GET"),
        Abuse("unknown model", completions, _json({**ok, "model": "other"}), 404, "not served here"),
        Abuse("n over the batch", completions, _json({**ok, "n": max_batch + 1}), 400, "batch"),
        Abuse(
            "prompt over the context",
            completions,
            _json({**ok, "prompt": [7] * 100_000}),
            400,
            "context holds",
        ),
        *_tokenize(model),
    ]


def _tokenize(model: str) -> list[Abuse]:
    """``/tokenize`` takes what a completion or chat request takes, no more."""
    user = [{"role": "user", "content": "hi"}]
    tool: dict[str, Any] = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    tools = [{**tool, "function": {**tool["function"], "name": f"f{i}"}} for i in range(10_000)]
    return [
        Abuse(
            "10,000 tools to chat",
            "/v1/chat/completions",
            _json({"messages": user, "tools": tools}),
            400,
            "tools",
        ),
        Abuse(
            "10,000 tools to /v1/responses",
            "/v1/responses",
            _json({"input": "hi", "tools": tools}),
            400,
            "tools",
        ),
        Abuse(
            "8 MiB prompt to /tokenize",
            "/tokenize",
            _json({"prompt": EIGHT_MIB_PROMPT}),
            400,
            "context holds",
        ),
        Abuse(
            "8 MiB chat message to /tokenize",
            "/tokenize",
            _json({"messages": [{"role": "user", "content": EIGHT_MIB_PROMPT}]}),
            400,
            "context holds",
        ),
        Abuse(
            "10,000 tools to /tokenize", "/tokenize", _json({"messages": user, "tools": tools}), 400, "tools"
        ),
        Abuse(
            "a tool without a name to /tokenize",
            "/tokenize",
            _json({"messages": user, "tools": [{"type": "function", "function": {}}]}),
            400,
            "name",
        ),
        Abuse(
            "too many messages to /tokenize",
            "/tokenize",
            _json({"messages": user * 200_000}),
            400,
            "messages",
        ),
        Abuse(
            "unknown model to /tokenize",
            "/tokenize",
            _json({"model": "x" + model, "prompt": "a"}),
            404,
            "not served",
        ),
    ]


def _deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def trickle(port: int, path: str = "/v1/completions", seconds: float = 10.0, host: str = "127.0.0.1") -> int:
    """Send a POST whose body comes one byte every 0.25 s, for at most ``seconds``; the status the server
    answers with (0: none before the time was up). For a loopback server only."""
    import socket
    import time

    body = b'{"prompt": "' + b"x" * 200 + b'"}'
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    deadline = time.monotonic() + seconds
    with socket.create_connection((host, port), timeout=seconds) as sock:
        sock.sendall(head)
        sock.settimeout(0.25)
        for byte in body:
            if time.monotonic() > deadline:
                return 0
            try:
                sock.sendall(bytes([byte]))
                answer = sock.recv(64)
            except TimeoutError:
                continue
            except OSError:  # the server closed the connection after answering
                return 0
            return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
    return 0


def unread_stream(
    port: int,
    path: str,
    body: dict[str, Any],
    wait_s: float,
    until: Callable[[], bool] = lambda: False,
    host: str = "127.0.0.1",
) -> bytes:
    """Send a streaming request, read nothing of its answer for ``wait_s`` seconds or until ``until()``
    holds (asked every 0.5 s; a small receive buffer, so the server's writes stall), then read it all;
    the bytes received. Loopback only."""
    import socket
    import time

    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, port))
        sock.sendall(head + data)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not until():
            time.sleep(0.5)
        sock.settimeout(30)
        received = bytearray()
        while chunk := sock.recv(1 << 16):
            received.extend(chunk)
        return bytes(received)
