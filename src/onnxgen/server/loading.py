"""What a port answers while the model loads: 503 to every request, ``/health`` included.

``onnxgen serve`` binds its port before loading the model (so a port in use fails at once); until the
app serves, :class:`LoadingResponder` answers each connection on that socket with a 503 (``Retry-After:
1``): ``{"status": "loading"}`` on ``/health``, an OpenAI-style error body elsewhere. So a load balancer
or Kubernetes probe sees "not ready" rather than a connection that hangs. It reads only the request head
(bounded in size and time), answers, and closes; stopping it leaves the socket listening for the app.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from types import TracebackType

MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 1.0
POLL_S = 0.05


def loading_reply(head: bytes) -> bytes:
    """The HTTP response to a request whose head is ``head``."""
    parts = head.split(b" ", 2)
    path = parts[1].split(b"?", 1)[0] if len(parts) > 1 else b""
    if path == b"/health":
        body: dict[str, object] = {"status": "loading"}
    else:
        message = "the model is still loading; retry shortly"
        body = {"error": {"message": message, "type": "server_unavailable", "param": None, "code": "loading"}}
    data = json.dumps(body).encode()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data
    )


class LoadingResponder:
    """Answers 503 on ``sock`` from a thread while the ``with`` block runs (see the module docstring)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="onnxgen-loading", daemon=True)

    def __enter__(self) -> LoadingResponder:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _serve(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], POLL_S)
            if not ready:
                continue
            try:
                conn, _ = self.sock.accept()
            except OSError:  # the client gave up between select and accept
                continue
            with conn:
                self._answer(conn)

    @staticmethod
    def _answer(conn: socket.socket) -> None:
        conn.settimeout(HEAD_TIMEOUT_S)
        head = b""
        try:
            while b"\r\n\r\n" not in head and len(head) < MAX_HEAD_BYTES:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                head += chunk
            conn.sendall(loading_reply(head))
        except OSError:  # a slow or vanished client: nothing to answer
            return
