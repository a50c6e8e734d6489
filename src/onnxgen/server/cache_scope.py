"""Which requests share cached prefixes (``--prefix-cache-scope``).

A hit in the prefix cache shows in ``usage.prompt_tokens_details.cached_tokens`` (and in how fast the
first token comes): a client that may probe a prefix another client cached can read that client's
prompt one token at a time. So each request reads and writes the cache only in its *scope*
(:attr:`~onnxgen.generation.params.SamplingParams.cache_salt` carries it to the engine):

- ``key`` (the default): requests share within the API key they were let in with (``--api-key``, one
  per user or team) and, inside it, within the ``cache_salt`` they send; with no key configured every
  client counts as one user (a single-user server), and only ``cache_salt`` separates them;
- ``salt``: only requests that send the same ``cache_salt`` share; a request without one shares
  nothing (the safe choice for a server without keys that several people use);
- ``shared``: every request shares, whatever its key; ``cache_salt`` still separates.
"""

from __future__ import annotations

import uuid

CACHE_SCOPES = ("key", "salt", "shared")
DEFAULT_CACHE_SCOPE = "key"


def check_cache_scope(scope: str) -> str:
    if scope not in CACHE_SCOPES:
        raise ValueError(
            f"--prefix-cache-scope must be one of {', '.join(CACHE_SCOPES)} (got {scope!r}); "
            f"'{DEFAULT_CACHE_SCOPE}' shares cached prefixes only among the requests of one API key"
        )
    return scope


def request_cache_salt(scope: str, api_key: int | None, salt: str | None) -> str | None:
    """The engine's cache salt of one request: its partition of the prefix cache under ``scope``, from
    the index of the API key it used (None: the server has none) and the ``cache_salt`` it sent."""
    parts = []
    if scope == "key" and api_key is not None:
        parts.append(f"key {api_key}")
    if salt is not None:
        parts.append(f"salt {salt}")
    elif scope == "salt":
        parts.append(f"request {uuid.uuid4().hex}")  # its own: found by no other request
    return "\n".join(parts) if parts else None
