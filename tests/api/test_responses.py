"""The /v1/responses protocol: requests as the official client sends them, input items as chat messages,
the event sequence and response object validated by the client's own types, and a round trip through
``client.responses.create`` (streamed and not) over an in-process transport."""

from __future__ import annotations

import json
from typing import Any

import pytest

from onnxgen.api.response_object import ResponseObject
from onnxgen.api.responses import ResponsesRequest
from onnxgen.api.responses_events import ResponseBuilder
from onnxgen.api.responses_input import chat_messages, conversation, input_messages
from onnxgen.api.store import ResponseStore
from onnxgen.chat.output import ChatStream
from onnxgen.chat.parsers import PARSERS
from onnxgen.chat.reasoning import ReasoningFormat
from onnxgen.chat.tools import parse_tools
from onnxgen.testing import tiny_tokenizer
from onnxgen.testing.chat_templates import HERMES_TEMPLATE, XML_TEMPLATE
from onnxgen.tokenizer import Tokenizer

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
REPLY = "The user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


def test_a_request_as_the_client_sends_it_is_read() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Use tools."}],
            },
        ],
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "reasoning": {"effort": "none"},
        "text": {
            "format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}
        },
        "max_output_tokens": 64,
        "stream": True,
        "store": False,
        "unknown_field": 1,
    }
    req = ResponsesRequest.model_validate(body)
    assert req.refuse_unsupported() is None
    assert req.chat_tools() == [
        {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
    ]
    assert req.chat_tool_choice() == {"type": "function", "function": {"name": "get_weather"}}
    assert req.response_format() == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}},
    }
    assert req.template_kwargs() == {"reasoning_effort": "none", "enable_thinking": False}
    assert chat_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "system", "content": "Use tools."},
    ]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "x", "detail": "auto"}]}
                ]
            },
            "input[0].content",
        ),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ],
)
def test_what_onnxgen_cannot_do_is_refused_by_field(body: dict[str, Any], field: str) -> None:
    refused = ResponsesRequest.model_validate(body).refuse_unsupported()
    assert refused is not None and refused[0] == field


def test_function_call_items_and_their_outputs_become_tool_turns_that_render() -> None:
    req = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Call it."}],
                },
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city": "Paris"}',
                },
                {
                    "type": "function_call",
                    "call_id": "call_2",
                    "name": "get_weather",
                    "arguments": '{"city": "Oslo"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {
                    "type": "function_call_output",
                    "call_id": "call_2",
                    "output": [{"type": "input_text", "text": "rain"}],
                },
            ]
        }
    )
    messages = input_messages(req)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[1]["reasoning_content"] == "Call it."
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_1", "call_2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "call_2", "content": "rain"}
    for template, call_text in [
        (XML_TEMPLATE, "<parameter=city>\nOslo\n</parameter>"),
        (HERMES_TEMPLATE, '"arguments": {"city": "Oslo"}'),
    ]:
        prompt = Tokenizer(tiny_tokenizer(512), {}, template).apply_chat_template(
            messages, tools=req.chat_tools() or None
        )
        assert call_text in prompt
        assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>" in prompt


def build(
    request: ResponsesRequest, reply: str, reason: str = "stop", chunk: int = 7
) -> tuple[ResponseBuilder, list[dict[str, Any]]]:
    builder = ResponseBuilder(ResponseObject.for_request(request, "tiny"))
    parser = ChatStream(ReasoningFormat(), True, PARSERS["qwen3_coder"], parse_tools(request.chat_tools()))
    events = builder.start()
    for i in range(0, len(reply), chunk):
        events += builder.feed(parser.feed(reply[i : i + chunk]))
    events += builder.feed(parser.finish())
    events += builder.finish(reason, input_tokens=11, output_tokens=40, reasoning_tokens=9)
    return builder, events


def test_the_event_sequence_validates_against_the_client_types() -> None:
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    req = ResponsesRequest.model_validate({"input": "Weather in Paris?", "tools": [TOOL], "stream": True})
    builder, events = build(req, REPLY)
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(e) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(events)))
    kinds = [e.type for e in parsed]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert kinds.index("response.output_text.delta") < kinds.index("response.function_call_arguments.delta")
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    final = Response.model_validate(builder.response.model_dump(mode="json"))
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Let me check."
    assert final.output[0].content[0].text == "The user wants weather."
    call = final.output[2]
    assert (call.name, json.loads(call.arguments), call.status) == (
        "get_weather",
        {"city": "Paris"},
        "completed",
    )
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens == 9


def test_a_reply_cut_at_the_token_limit_is_incomplete() -> None:
    from openai.types.responses import Response

    req = ResponsesRequest.model_validate({"input": "hi", "max_output_tokens": 5})
    builder, events = build(req, "partial thoughts", reason="length")
    assert events[-1]["type"] == "response.incomplete"
    final = Response.model_validate(builder.response.model_dump(mode="json"))
    assert final.status == "incomplete" and final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens" and final.output[0].status == "incomplete"


def serve(store: ResponseStore, replies: list[str], seen: list[list[dict[str, Any]]]) -> Any:
    """An in-process /v1/responses: the canned replies stand in for the model."""

    def handler(request: Any) -> Any:
        req = ResponsesRequest.model_validate(json.loads(request.content))
        previous = store.get(req.previous_response_id) if req.previous_response_id else None
        history = previous.messages if previous else []
        seen.append(chat_messages(req, history))
        builder, events = build(req, replies[len(seen) - 1])
        store.put(
            builder.response.id,
            builder.response.model_dump(mode="json"),
            conversation(req, history, builder.response),
        )
        if not req.stream:
            return httpx.Response(200, json=builder.response.model_dump(mode="json"))
        sse = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    return handler


def test_client_round_trip_streamed_and_not_with_previous_response_id() -> None:
    store = ResponseStore()
    seen: list[list[dict[str, Any]]] = []
    second = "Paris is sunny.</think>It is sunny in Paris."
    transport = httpx.MockTransport(serve(store, [REPLY, second], seen))
    client = openai.OpenAI(
        api_key="x", base_url="http://test/v1", http_client=httpx.Client(transport=transport)
    )
    first = client.responses.create(
        model="tiny", input="Weather in Paris?", tools=[TOOL], instructions="Be brief."
    )
    assert first.output_text == "Let me check." and first.output[-1].type == "function_call"
    stream = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": first.output[-1].call_id, "output": "sunny"}],
        stream=True,
    )
    events = list(stream)
    assert events[-1].type == "response.completed"
    assert (
        "".join(e.delta for e in events if e.type == "response.output_text.delta") == "It is sunny in Paris."
    )
    # the second request read the first one's conversation (without its instructions), then the tool result
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "tool"]
    assert seen[1][1]["tool_calls"][0]["id"] == first.output[-1].call_id
    assert seen[1][1]["reasoning_content"] == "The user wants weather."


def test_the_store_evicts_the_least_recently_used_by_count_and_bytes() -> None:
    store = ResponseStore(max_items=2, max_bytes=10_000)
    small = [{"role": "user", "content": "x"}]
    store.put("a", {}, small)
    store.put("b", {}, small)
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", {}, small)
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    big = [{"role": "user", "content": "y" * 6_000}]
    store.put("d", {}, big)
    assert store.bytes <= 10_000 and store.get("d") is not None
    assert not store.put("huge", {}, [{"role": "user", "content": "z" * 20_000}])
    assert store.get("huge") is None
    assert store.delete("d") and not store.delete("d")
