"""Connections below the app: idle and header-dripping connections are closed by the header deadline,
and SIGTERM ends the server within ``--shutdown-timeout`` even while a client holds a stream unread."""

from __future__ import annotations

import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from server_helpers import ServerProcess

from onnxgen.server.connections import ConnectionLimits
from onnxgen.testing import TinySpec, build_model
from onnxgen.testing.abuse import unread_stream

CHAT = {"messages": [{"role": "user", "content": "hi"}], "n": 8, "logprobs": True, "top_logprobs": 20}


def closed_by_server(sock: socket.socket, drip: bool, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (``drip``: a header byte every 0.2 s)."""
    deadline = time.monotonic() + seconds
    sock.settimeout(0.2)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000
    sent = 0
    while time.monotonic() < deadline:
        try:
            if drip and sent < len(head):
                sock.sendall(head[sent : sent + 1])
                sent += 1
            if sock.recv(1024) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:  # reset
            return True
    return False


def test_idle_and_header_dripping_connections_are_closed_and_others_served(
    server_models: dict[str, Path], tmp_path: Path
) -> None:
    server = ServerProcess(server_models["genai-dense"], tmp_path / "log", "--header-timeout", "1")
    try:
        socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(6)]
        results: list[bool] = [False] * 6
        threads = [
            threading.Thread(
                target=lambda i=i: results.__setitem__(i, closed_by_server(socks[i], i % 2 == 0, 5))
            )
            for i in range(6)
        ]
        for t in threads:
            t.start()
        r = server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        for t in threads:
            t.join()
        assert results == [True] * 6
        for s in socks:
            s.close()
    finally:
        server.close()


def test_sigterm_ends_the_server_within_the_shutdown_timeout_while_a_stream_is_held_unread(
    tmp_path: Path,
) -> None:
    model = build_model(tmp_path / "dense2k", "genai-dense", TinySpec(max_position=2048))
    server = ServerProcess(model, tmp_path / "log", "--shutdown-timeout", "2")
    try:
        body = {**CHAT, "max_tokens": 1900, "stream": True, "ignore_eos": True}  # more than sockets hold
        holder = threading.Thread(
            target=unread_stream, args=(server.port, "/v1/chat/completions", body, 20.0), daemon=True
        )
        holder.start()
        time.sleep(1.5)  # the stream is running, its client reading nothing
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=15)
        assert time.monotonic() - start < 10
    finally:
        server.close()


def test_connection_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="--keep-alive-timeout"):
        ConnectionLimits(keep_alive=0)
    with pytest.raises(ValueError, match="--header-timeout"):
        ConnectionLimits(header_timeout=-1)
