"""Chat Completions and Completions bodies for parsed replies and logprobs, validated by the official
client's types."""

from __future__ import annotations

from typing import Any

import pytest

from onnxgen.api.chat import NEG_INF_LOGPROB, chat_delta, chat_logprobs, chat_message, completion_logprobs
from onnxgen.chat.output import ChatStream, parse_output
from onnxgen.chat.parsers import PARSERS
from onnxgen.chat.reasoning import ReasoningFormat
from onnxgen.generation.logprobs import TokenLogprob

openai = pytest.importorskip("openai")

REPLY = (
    '<think>\nplan\n</think>\n\nOK.\n<tool_call>\n{"name": "f", "arguments": {"a": [1, "}"]}}\n</tool_call>'
)
PIECES = {1: b"Hi", 2: b" \xc3", 3: b"\xa9"}  # token 2 ends in half of "é"


def token_bytes(token_id: int) -> bytes:
    return PIECES[token_id]


def completion(message: dict[str, Any], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice = {"index": 0, "finish_reason": "tool_calls", "message": message, "logprobs": logprobs}
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}


def test_a_parsed_reply_is_a_chat_completion_message() -> None:
    from openai.types.chat import ChatCompletion

    output = parse_output(REPLY, ReasoningFormat(), False, PARSERS["hermes"], None)
    body = ChatCompletion.model_validate(completion(chat_message(output)))
    message = body.choices[0].message
    assert message.content == "OK."
    assert message.tool_calls is not None and message.tool_calls[0].function.arguments == '{"a": [1, "}"]}'
    extra = message.model_extra or {}
    assert extra["reasoning_content"] == extra["reasoning"] == "plan"
    assert chat_message(parse_output("", None))["content"] == ""  # OpenAI: a string unless there are calls
    calls_only = parse_output(
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', None, False, PARSERS["hermes"]
    )
    assert chat_message(calls_only)["content"] is None and chat_message(calls_only)["tool_calls"]


def test_streamed_deltas_rebuild_the_message_in_chunks() -> None:
    from openai.types.chat import ChatCompletionChunk

    stream = ChatStream(ReasoningFormat(), False, PARSERS["hermes"], None)
    deltas = [d for i in range(0, len(REPLY), 5) for d in stream.feed(REPLY[i : i + 5])] + stream.finish()
    content, reasoning, args, names = "", "", "", []
    for delta in deltas:
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        chunk["choices"] = [{"index": 0, "delta": chat_delta(delta), "finish_reason": None}]
        parsed = ChatCompletionChunk.model_validate(chunk).choices[0].delta
        content += parsed.content or ""
        reasoning += (parsed.model_extra or {}).get("reasoning_content", "")
        for call in parsed.tool_calls or []:
            if call.id is not None:
                names.append(call.function.name if call.function else None)
            args += call.function.arguments or "" if call.function else ""
    assert (content, reasoning, names, args) == ("OK.", "plan", ["f"], '{"a": [1, "}"]}')


def test_logprobs_bodies_keep_bytes_and_write_inf_as_a_number() -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    scores = [
        TokenLogprob(1, -0.5, ((1, -0.5), (2, -1.5))),
        TokenLogprob(2, -2.0, ((1, -0.1), (3, float("-inf")))),
    ]
    body = ChatCompletion.model_validate(
        completion({"role": "assistant", "content": "Hi é"}, chat_logprobs(scores, token_bytes))
    )
    content = body.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [c.token for c in content] == ["Hi", " \ufffd"]
    assert content[1].bytes == [32, 0xC3]  # the exact bytes, though the text cannot show half a character
    assert content[1].top_logprobs[1].logprob == NEG_INF_LOGPROB
    legacy = completion_logprobs(scores, token_bytes, offset=3)
    text_choice = {"index": 0, "text": "Hi é", "finish_reason": "length", "logprobs": legacy}
    parsed = Completion.model_validate(
        {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [text_choice]}
    )
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.text_offset == [3, 5] and parsed.choices[0].logprobs.token_logprobs == [
        -0.5,
        -2.0,
    ]
