"""The response object of ``/v1/responses`` and its output items, shaped as the ``openai`` client's types.

:class:`ResponseObject` starts from the request (:meth:`ResponseObject.for_request`) with status
``in_progress``; :class:`onnxgen.api.responses_events.ResponseBuilder` fills its output and usage.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from onnxgen.api.responses import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class MessageOutput(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningOutput(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class FunctionCallOutput(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


OutputItem = MessageOutput | ReasoningOutput | FunctionCallOutput


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] = Field(
        default_factory=lambda: {"cached_tokens": 0, "cache_write_tokens": 0}
    )
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: float
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: Usage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    completed_at: float | None = None

    @classmethod
    def for_request(
        cls, request: ResponsesRequest, model: str, response_id: str | None = None
    ) -> ResponseObject:
        """The object of ``request`` before any output (status ``in_progress``)."""
        return cls(
            id=response_id or new_id("resp"),
            created_at=time.time(),
            model=model,
            instructions=request.instructions,
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools or []],
            tool_choice=request.tool_choice if request.tool_choice is not None else "auto",
            parallel_tool_calls=request.parallel_tool_calls is not False,
            temperature=request.temperature,
            top_p=request.top_p,
            max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id,
            reasoning=request.reasoning.model_dump(exclude_none=True) if request.reasoning else None,
            text=request.text.model_dump(exclude_none=True, by_alias=True) if request.text else None,
            top_logprobs=request.top_logprobs,
            store=request.store,
            metadata=request.metadata or {},
        )
