"""Who may use the server: the Host it is reached by, the web page a browser request comes from, the key.

A server on loopback is reachable from every web page its user opens. Three checks keep pages out:

- ``Host``: a page on a domain the attacker re-points at 127.0.0.1 (DNS rebinding) sends its own name
  as Host; only the bound address, loopback names and ``--allowed-hosts`` are answered (a server bound
  to all interfaces checks only when ``--allowed-hosts`` is given; ``*`` turns the check off).
- ``Origin``: a browser names the page behind every cross-origin request; one from another origin than
  the server's own is refused (403) unless ``--cors-origins`` lists it, and then CORS (preflight
  included) is answered by Starlette's ``CORSMiddleware`` in front of this guard.
- the API key (``--api-key``, which may be given more than once: one key per user or team): every path
  but ``/health`` (and ``/metrics`` with ``--metrics-open``, for a Prometheus scraper without the key)
  needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY``, compared in constant time with every key;
  401 otherwise. Which key a request used is kept in its ASGI scope (:func:`api_key_of`): the prefix
  cache is partitioned by it (docs/prefix-cache.md).

POST bodies must also be declared ``application/json`` (:func:`onnxgen.server.body.read_body`), so no
page can send one without a CORS preflight.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from onnxgen.server.protocol import ApiError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ALL_INTERFACES = frozenset({"", "0.0.0.0", "::"})
OPEN_PATHS = frozenset({"/health"})  # answered without the API key (load balancers, readiness probes)
_KEY_STATE = "onnxgen_api_key"  # the index of the key a request was let in with, in its scope's state


@dataclass(frozen=True)
class SecurityConfig:
    """What :class:`Guard` lets through.

    Attributes:
        host: the address the server is bound to.
        api_key: the key clients send as ``Authorization: Bearer KEY``, or several (any one of them
            lets a request in); None: no key needed.
        allowed_hosts: Host names answered besides the bound address and loopback names (``*``: any).
        cors_origins: origins of web pages allowed to call the API from a browser (``*``: any).
        docs: serve ``/docs`` and ``/openapi.json``.
        metrics_open: answer ``/metrics`` without the API key (vLLM never asks a key there; onnxgen does
            unless told).
    """

    host: str = "127.0.0.1"
    api_key: str | tuple[str, ...] | None = None
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    docs: bool = False
    metrics_open: bool = False

    def __post_init__(self) -> None:
        for key in self.api_keys:
            if not key.strip():
                raise ValueError(
                    "the API key is empty; pass a non-empty --api-key (or unset ONNXGEN_API_KEY)"
                )
            if key != key.strip():  # a client's token is read without surrounding whitespace: never equal
                raise ValueError(
                    f"the API key has {'leading' if key[0].isspace() else 'trailing'} whitespace, which no "
                    "client can send in an Authorization header; remove it from --api-key (or ONNXGEN_API_KEY)"
                )

    @property
    def api_keys(self) -> tuple[str, ...]:
        """Every key that lets a request in (empty: none needed)."""
        if self.api_key is None:
            return ()
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key)

    def host_names(self) -> frozenset[str] | None:
        """The Host names answered (lower case, no port); None answers any."""
        if "*" in self.allowed_hosts or (self.host in ALL_INTERFACES and not self.allowed_hosts):
            return None
        names = {name.lower().strip("[]") for name in self.allowed_hosts} | LOOPBACK_NAMES
        if self.host not in ALL_INTERFACES:
            names.add(self.host.lower().strip("[]"))
        return frozenset(names)


def host_name(value: str) -> str:
    """The name part of a Host header: ``Example.com:8000`` -> ``example.com``, ``[::1]:80`` -> ``::1``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _origin_netloc(origin: str) -> str:
    return origin.split("://", 1)[-1].rstrip("/").lower()


class Guard:
    """ASGI middleware that refuses requests by Host (400), Origin (403) and API key (401)."""

    def __init__(self, app: ASGIApp, config: SecurityConfig) -> None:
        self.app = app
        self.names = config.host_names()
        self.origins = frozenset(o.rstrip("/").lower() for o in config.cors_origins)
        self.keys = [key.encode() for key in config.api_keys]
        self.open_paths = OPEN_PATHS | ({"/metrics"} if config.metrics_open else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self._refusal(scope, Headers(scope=scope))
            if refused is not None:
                await refused.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope, headers: Headers) -> ApiError | None:
        host = headers.get("host", "")
        if self.names is not None and host and host_name(host) not in self.names:
            return ApiError(
                400,
                f"this server does not answer to Host {host!r} (a page that re-points its own domain at "
                "this address would send that); add the name with --allowed-hosts",
                code="host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, host):
            return ApiError(
                403,
                f"cross-origin request from {origin!r} refused; start the server with --cors-origins "
                f"{origin} to let web pages from there call it",
                code="origin_not_allowed",
            )
        if self.keys and scope["path"] not in self.open_paths:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            bearer = token.strip().encode("latin-1", "replace") if scheme.lower() == "bearer" else None
            other = headers.get("x-api-key")
            given = [k for k in (bearer, other.strip().encode("latin-1", "replace") if other else None) if k]
            # every key is compared (in constant time), so the time taken does not tell which one matched
            matches = [sum(hmac.compare_digest(g, key) for g in given) > 0 for key in self.keys]
            if any(matches):
                scope.setdefault("state", {})[_KEY_STATE] = matches.index(True)
            else:
                return ApiError(
                    401,
                    "this server needs an API key: send the header Authorization: Bearer <key> "
                    "(or x-api-key: <key>)",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return None

    def _origin_allowed(self, origin: str, host: str) -> bool:
        if "*" in self.origins or origin.rstrip("/").lower() in self.origins:
            return True
        return bool(host) and _origin_netloc(origin) == host.strip().lower()  # the server's own pages


def api_key_of(scope: Mapping[str, Any]) -> int | None:
    """Which of the server's API keys the request of ``scope`` was let in with (its index; None where
    the server needs no key)."""
    index = scope.get("state", {}).get(_KEY_STATE)
    return index if isinstance(index, int) else None
