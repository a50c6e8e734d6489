"""Tool-call parsers by output format, and the choice of one from the chat template or a name.

=================  ============================================================  ======================
name               format                                                        models
=================  ============================================================  ======================
``hermes``         ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``  Qwen2.5, Qwen3, Hermes
``qwen3_coder``    ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n...``    Qwen3-Coder, Qwen3.5
=================  ============================================================  ======================

The names are vLLM's ``--tool-call-parser`` names. A template that writes ``<function=`` and
``<parameter=`` tags gets ``qwen3_coder``; one that mentions ``<tool_call>`` otherwise gets ``hermes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

from onnxgen.chat import hermes, xml_calls
from onnxgen.chat.calls import CallBody, ToolCallStream
from onnxgen.chat.tools import ChatInputError, Tool, ToolCall


@dataclass(frozen=True)
class ToolParser:
    """One output format of tool calls: its tags and the scanner of a call's body."""

    name: str
    start_tag: str
    end_tag: str
    body: type[CallBody]

    def stream(self, tools: Sequence[Tool] | None = None, hold_calls: bool = False) -> ToolCallStream:
        """A parser for one streamed reply (``tools``: the calls allowed; None accepts any name;
        ``hold_calls``: send each call whole once it is complete, see :mod:`onnxgen.chat.calls`)."""
        return ToolCallStream(self.start_tag, self.body, tools, hold_calls, self.end_tag)

    def parse(self, text: str, tools: Sequence[Tool] | None = None) -> tuple[str, list[ToolCall]]:
        """``(content, calls)`` of a whole reply; malformed calls stay in the content."""
        stream = self.stream(tools)
        stream.feed(text, final=True)
        return stream.content, stream.calls


PARSERS = {
    "hermes": ToolParser("hermes", hermes.START_TAG, hermes.END_TAG, hermes.HermesBody),
    "qwen3_coder": ToolParser("qwen3_coder", xml_calls.START_TAG, xml_calls.END_TAG, xml_calls.XmlBody),
}
ALIASES = {"qwen3_xml": "qwen3_coder"}
DEFAULT_PARSER = "hermes"  # the server's parser where neither a flag nor the template names one


@overload
def tool_parser_for(name: str, template: str | None = None) -> ToolParser: ...
@overload
def tool_parser_for(name: None = None, template: str | None = None) -> ToolParser | None: ...
def tool_parser_for(name: str | None = None, template: str | None = None) -> ToolParser | None:
    """The parser called ``name``, else the one the chat ``template`` text implies, else None."""
    if name is not None:
        parser = PARSERS.get(ALIASES.get(name, name))
        if parser is None:
            known = ", ".join(sorted([*PARSERS, *ALIASES]))
            raise ChatInputError(f"unknown tool-call parser {name!r}; choose one of {known}")
        return parser
    if template is None:
        return None
    if xml_calls.FUNCTION in template and xml_calls.PARAMETER in template:
        return PARSERS["qwen3_coder"]
    if hermes.START_TAG in template:
        return PARSERS["hermes"]
    return None


def server_tool_parser(name: str | None, template: str | None) -> tuple[ToolParser, str]:
    """The server's tool-call parser and where it comes from: ``name`` (``--tool-call-parser``), else the
    one the chat ``template`` implies, else :data:`DEFAULT_PARSER` (most chat models that call tools
    without saying so in their template write hermes' ``<tool_call>`` JSON, as vLLM's default does)."""
    if name is not None:
        return tool_parser_for(name), "--tool-call-parser"
    implied = tool_parser_for(None, template)
    if implied is not None:
        return implied, "the chat template"
    return PARSERS[DEFAULT_PARSER], "the default: the chat template shows no tool-call format"
