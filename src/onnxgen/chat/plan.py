"""One chat request planned: its prompt, its sampling parameters with the tool-call grammar and reasoning
gate, and the parser of its reply. ``LLM.chat`` and the server plan requests the same way.

- Tools reach the model through the chat template (its ``tools`` variable); the tool-call parser is the
  one named, or the one the template's text implies (:func:`~onnxgen.chat.parsers.tool_parser_for`).
- With ``tool_choice`` ``"required"`` or a named function, and by default with ``"auto"``, the reply is
  constrained by :func:`~onnxgen.chat.grammar.tool_call_grammar`, so calls are always well-formed.
- A template that writes ``</think>`` makes the reply a thinking one: reasoning is split from the answer,
  and any constraint (tool calls, a JSON schema) applies after the reasoning section, unless the prompt
  already closed the section (thinking turned off, e.g. ``enable_thinking=False``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from onnxgen.chat.grammar import quoted, tool_call_grammar
from onnxgen.chat.output import ChatOutput, ChatStream, parse_output
from onnxgen.chat.parsers import ToolParser, tool_parser_for
from onnxgen.chat.reasoning import THINK_END, ReasoningFormat, reasoning_opened
from onnxgen.chat.tools import ChatInputError, Tool, ToolChoice, parse_tool_choice, parse_tools
from onnxgen.generation.params import ReasoningSection, SamplingParams
from onnxgen.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatPlan:
    """What a chat request runs (``prompt``, ``params``) and how its reply is read."""

    prompt: str
    params: SamplingParams
    tools: list[Tool]
    tool_choice: ToolChoice
    tool_parser: ToolParser | None
    reasoning: ReasoningFormat | None
    reasoning_opened: bool

    def stream(self, hold_calls: bool = False) -> ChatStream:
        """A parser for the streamed reply (``hold_calls``: each tool call sent whole once complete, so a
        call cut by the token limit is dropped as :meth:`parse` drops it)."""
        return ChatStream(self.reasoning, self.reasoning_opened, self.tool_parser, self.tools, hold_calls)

    def parse(self, text: str) -> ChatOutput:
        """The whole reply parsed."""
        return parse_output(text, self.reasoning, self.reasoning_opened, self.tool_parser, self.tools)

    @staticmethod
    def finish_reason(reason: str, output: ChatOutput) -> str:
        """OpenAI's finish reason: ``"tool_calls"`` when a reply that ended on its own made calls."""
        return "tool_calls" if output.tool_calls and reason == "stop" else reason


def _with_tool_grammar(
    params: SamplingParams,
    parser: ToolParser,
    tools: list[Tool],
    choice: ToolChoice,
    parallel: bool,
    literal: Callable[[str], str],
) -> SamplingParams:
    if params.constraint not in (None, "json_schema") or (params.json_schema and choice.forces_call):
        raise ChatInputError(
            f"tool_choice {choice.mode!r} constrains the reply to tool calls, which cannot be combined with "
            f"{params.constraint}; drop one of them (a json_schema combines with tool_choice 'auto' only)"
        )
    schema = json.loads(str(params.json_schema)) if params.json_schema else None
    grammar = tool_call_grammar(
        parser,
        tools,
        choice,
        parallel,
        literal,
        answer_schema=schema,
        extra_properties=params.json_extra_properties,
    )
    return replace(params, json_schema=None, tool_grammar=grammar) if grammar else params


def plan_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    params: SamplingParams,
    *,
    tools: Sequence[object] | None = None,
    tool_choice: object = None,
    parallel_tool_calls: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
    tool_parser: str | None = None,
    reasoning: bool | None = None,
    constrain_calls: bool = True,
    literal: Callable[[str], str] = quoted,
) -> ChatPlan:
    """Plan one chat request (see the module docstring).

    ``reasoning``: None splits reasoning when the template writes ``</think>``; True or False forces it.
    ``constrain_calls=False`` leaves ``"auto"`` replies unconstrained (``"required"`` and named functions
    always get the grammar). ``literal`` spells tags in grammars (the model's constraint compiler's).
    """
    tool_list = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, tool_list)
    template = tokenizer.chat_template or ""
    parser = None
    if tool_list and choice.mode != "none":
        parser = tool_parser_for(tool_parser, template)
        if parser is None:
            raise ChatInputError(
                "the chat template shows no tool-call format onnxgen knows (no <tool_call> tag); name the "
                "format with tool_parser='hermes' or 'qwen3_coder' (onnxgen serve: --tool-call-parser "
                "hermes), or use a template that supports tools"
            )
    kwargs = dict(template_kwargs or {})
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tools=tool_list or None, **kwargs
    )
    fmt = ReasoningFormat() if (THINK_END in template if reasoning is None else reasoning) else None
    opened = fmt is not None and reasoning_opened(prompt, fmt.start, fmt.end)
    if parser is not None and (choice.forces_call or constrain_calls):
        params = _with_tool_grammar(params, parser, tool_list, choice, parallel_tool_calls, literal)
    # a prompt that ends with a closed section turned thinking off (enable_thinking=False): no gate then
    thinking = fmt is not None and not prompt.rstrip().endswith(fmt.end)
    if fmt is not None and thinking and params.constraint is not None:
        params = replace(params, reasoning_section=ReasoningSection(opened, fmt.start, fmt.end))
    if not params.detokenize:  # replies are parsed from text: without it there is nothing to parse
        parser, fmt = None, None
    return ChatPlan(prompt, params, tool_list, choice, parser, fmt, opened)
