"""The Chat Completions and Completions bodies of one request, whole or streamed, from its deltas.

A chat reply is parsed by the request's :class:`~onnxgen.chat.plan.ChatPlan`: the thinking goes out as
``reasoning_content`` (and ``reasoning``), tool calls as ``tool_calls`` with the finish reason
``tool_calls``; streamed, each choice has its own parser, and a call streams as OpenAI streams it (its
id and name first, then pieces of ``arguments``). A model's malformed call is content, as the parsers
return it. Log-probabilities ride on the chunk that carries their tokens' text (a token whose text is
held back gives its logprob to the next chunk).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from onnxgen.api.chat import TokenBytes, chat_delta, chat_logprobs, chat_message, completion_logprobs
from onnxgen.chat.deltas import merge_deltas
from onnxgen.chat.output import ChatStream
from onnxgen.chat.plan import ChatPlan
from onnxgen.generation.logprobs import TokenLogprob
from onnxgen.server.protocol import new_id
from onnxgen.server.sequence import Delta


@dataclass
class ChoiceResult:
    """One collected choice: its text pieces, finish reason, token ids and (when asked) logprobs."""

    text: str
    reason: str | None
    token_ids: list[int]
    scores: list[TokenLogprob]


class ResponseShape:
    """Builds the bodies of one request: chat (``plan`` given) or completions.

    ``top_logprobs``: the alternatives per token when the request asked for logprobs, else None;
    ``token_ids``: each choice (or chunk) also carries the generated token ids.
    """

    def __init__(
        self,
        model: str,
        choices: int,
        plan: ChatPlan | None,
        token_bytes: TokenBytes,
        top_logprobs: int | None = None,
        token_ids: bool = False,
    ) -> None:
        self.model, self.plan, self.token_bytes = model, plan, token_bytes
        self.chat = plan is not None
        self.logprobs = top_logprobs is not None
        self.token_ids = token_ids
        self.id = new_id("chatcmpl" if self.chat else "cmpl")
        self.created = int(time.time())
        self._object = "chat.completion.chunk" if self.chat else "text_completion"
        self._parsers: list[ChatStream] = (
            [plan.stream(hold_calls=True) for _ in range(choices)] if plan else []
        )
        self._pending: list[list[TokenLogprob]] = [[] for _ in range(choices)]
        self._offsets = [0] * choices  # completions: the text offset of each choice's next token

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- whole ----------------------------------------------------------------------------------------
    def response(self, results: Sequence[ChoiceResult], use: dict[str, int]) -> dict[str, Any]:
        choices = []
        for index, result in enumerate(results):
            choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": result.reason}
            if self.token_ids:
                choice["token_ids"] = result.token_ids
            if self.plan is not None:
                output = self.plan.parse(result.text)
                choice["message"] = chat_message(output)
                choice["finish_reason"] = self.plan.finish_reason(result.reason or "stop", output)
            else:
                choice["text"] = result.text
            if self.logprobs:
                choice["logprobs"] = self._logprobs(index, result.scores)
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": use}

    def _logprobs(self, index: int, scores: Sequence[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            return chat_logprobs(scores, self.token_bytes)
        body = completion_logprobs(scores, self.token_bytes, self._offsets[index])
        if body["tokens"]:
            self._offsets[index] = body["text_offset"][-1] + len(body["tokens"][-1])
        return body

    # -- streamed -------------------------------------------------------------------------------------
    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams start with a ``{"role": "assistant"}`` delta per choice (completions: nothing)."""
        if not self.chat:
            return []
        return [
            self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None})
            for i in range(len(self._parsers))
        ]

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        """The chunk of one token's delta, or None when it has nothing to send yet (text held back)."""
        index, reason = delta.index, delta.finish_reason
        if delta.logprob is not None:
            self._pending[index].append(delta.logprob)
        choice: dict[str, Any] = {"index": index}
        if self.plan is not None:
            parser = self._parsers[index]
            body = chat_delta(merge_deltas(parser.feed(delta.text, final=reason is not None)))
            if reason is not None:
                reason = self.plan.finish_reason(reason, parser.output)
            empty = not body
            choice["delta"] = body
        else:
            empty = not delta.text
            choice["text"] = delta.text
        if empty and reason is None and not self.token_ids:
            return None
        choice["logprobs"] = None
        if self.logprobs and self._pending[index]:
            choice["logprobs"] = self._logprobs(index, self._pending[index])
            self._pending[index] = []
        choice["finish_reason"] = reason
        if self.token_ids:
            choice["token_ids"] = [delta.token_id]
        return self._chunk(choice)

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(self._object), "choices": [choice]}

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        return {**self._head(self._object), "choices": [], "usage": use}
