"""The narrow interface the route modules use: what they may ask of the server and its engine.

Routes prepare a request body on the worker pool (:meth:`Service.prepare`), queue the prepared request
(:meth:`Service.submit`) and read its deltas from the returned stream; they read the model's name,
tokens' bytes and the response store, and nothing else of the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from starlette.requests import Request

from onnxgen.api.store import ResponseStore
from onnxgen.server.prepare import Prepared, RequestPreparer
from onnxgen.server.streaming import RequestStream

T = TypeVar("T")


class Service(Protocol):
    model_name: str
    preparer: RequestPreparer
    store: ResponseStore

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (logprobs bodies carry them)."""
        ...

    async def prepare(self, request: Request, work: Callable[[bytes], T]) -> T:
        """Read the body of ``request`` and run ``work`` on it on the worker pool."""
        ...

    def submit(self, prepared: Prepared) -> RequestStream:
        """Queue ``prepared``; its deltas arrive on the returned stream (503 when the queue is full)."""
        ...
