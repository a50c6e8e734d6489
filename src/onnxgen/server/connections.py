"""Limits on connections, below the app: uvicorn's keep-alive timeout, connection limit and graceful
shutdown deadline, and a deadline for a request's headers that uvicorn lacks.

uvicorn closes a connection idle after a response (``timeout_keep_alive``), but not one that was opened
and never sent a request, nor one whose headers arrive a byte at a time: each holds a socket and a slot
of ``limit_concurrency`` for as long as its client likes. :func:`header_deadline_protocol` closes a
connection that has not begun a request (its headers complete) within ``seconds`` of connecting or of
its previous response.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5  # uvicorn's default
MAX_CONNECTIONS = 1024
SHUTDOWN_TIMEOUT_S = 20


@dataclass(frozen=True)
class ConnectionLimits:
    """``--header-timeout``, ``--keep-alive-timeout``, ``--max-connections`` (beyond them a request gets
    503) and ``--shutdown-timeout`` (after SIGTERM, streams still open then are cut)."""

    header_timeout: float = HEADER_TIMEOUT_S
    keep_alive: int = KEEP_ALIVE_S
    max_connections: int = MAX_CONNECTIONS
    shutdown_timeout: int = SHUTDOWN_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("header_timeout", "keep_alive", "max_connections", "shutdown_timeout"):
            value = getattr(self, name)
            if not value > 0:
                flag = "--" + name.replace("_", "-").replace("keep-alive", "keep-alive-timeout")
                raise ValueError(f"{flag} must be > 0 (got {value})")

    def uvicorn_options(self) -> dict[str, Any]:
        """The keyword arguments of ``uvicorn.Config`` that apply these limits."""
        return {
            "http": header_deadline_protocol(self.header_timeout),
            "timeout_keep_alive": self.keep_alive,
            "limit_concurrency": self.max_connections,
            "timeout_graceful_shutdown": self.shutdown_timeout,
        }


def header_deadline_protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (the one it would choose) closing connections that start no request
    within ``seconds`` (checked every ``seconds``: a connection goes within one to two of them)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol

    class HeaderDeadlineProtocol(base):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._waiting_since: Any = None  # the cycle (None: none yet) a request has not followed
            self._check = self.loop.call_later(seconds, self._check_headers)

        def _check_headers(self) -> None:
            cycle = self.cycle
            between = cycle is None or cycle.response_complete  # no request in flight
            if between and cycle is self._waiting_since:  # and none began since the last check
                self.transport.close()
                return
            self._waiting_since = cycle if between else object()
            self._check = self.loop.call_later(seconds, self._check_headers)

        def connection_lost(self, exc: Exception | None) -> None:
            self._check.cancel()
            super().connection_lost(exc)

    return HeaderDeadlineProtocol
