"""llguidance (Lark) grammars that make a reply's tool calls well-formed, in the model's own call format.

- ``tool_choice="required"``: the reply is one or more calls (one when ``parallel_tool_calls`` is off);
- a named function: one call of that function;
- ``"auto"``: free text, or free text followed by calls. The free text may not contain the start tag,
  so anything that starts a call is a complete, valid call.

Each call names a tool of the request and its arguments follow that tool's parameter schema: as JSON
(Hermes format) or as ``<parameter=...>`` blocks (Qwen3-Coder XML format: text parameters are text up to
``</parameter>`` within their ``minLength``/``maxLength``, string enums and consts are enforced, and the
other parameters are JSON under their schema).
Schemas are compiled leniently: keywords llguidance does not implement are ignored rather than refused.

Tags such as ``<tool_call>`` are special tokens in some tokenizers (Qwen's); a grammar must then name
the token, not spell the text. ``literal`` gives the grammar syntax for a fixed text
(:meth:`onnxgen.generation.constraints.ConstraintCompiler.literal` knows the model's tokenizer).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from onnxgen.chat.parsers import ToolParser
from onnxgen.chat.tools import Tool, ToolChoice
from onnxgen.chat.xml_calls import FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END, is_text_parameter
from onnxgen.generation.schema_objects import close_objects

Literal = Callable[[str], str]
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


def quoted(text: str) -> str:
    """A Lark string literal of ``text`` (the default ``literal``: no special tokens)."""
    return json.dumps(text, ensure_ascii=False)


def regex_of(text: str) -> str:
    """A Lark ``/regex/`` body matching ``text`` exactly."""
    return re.escape(text).replace("/", "\\/")


def with_layout(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` with the compact JSON layout the models write (its own ``x-guidance`` wins)."""
    return {**schema, "x-guidance": {**JSON_LAYOUT, **(schema.get("x-guidance") or {})}}


def is_token(syntax: str) -> bool:
    """True when ``literal`` gave a special-token reference rather than a string."""
    return syntax.startswith("<[")


def free_text(tag: str) -> str:
    """A Lark terminal body: any text that does not contain ``tag``."""
    return f"/(?s:.*)/ & ~/(?s:.*){regex_of(tag)}(?s:.*)/"


def _hermes_call(tools: Sequence[Tool]) -> str:
    """The body of a Hermes call (what follows the start tag, before the end tag)."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": dict(tool.parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return f'"\\n" %json {json.dumps(with_layout(schema), ensure_ascii=False)} "\\n"'


def _text_value(schema: object, rules: list[str]) -> str:
    """The rule of a text value (lazy: it ends at the first closing tag), bounded by the schema's
    ``minLength``/``maxLength``; other string keywords (``pattern``, ``format``) are not enforced."""
    low = schema.get("minLength", 0) if isinstance(schema, Mapping) else 0
    high = schema.get("maxLength") if isinstance(schema, Mapping) else None
    low = low if isinstance(low, int) and low > 0 else 0
    high = high if isinstance(high, int) and high >= low else None
    name = f"text_{low}_{'' if high is None else high}"
    close = f"\\n{regex_of(PARAMETER_END)}\\n"
    body = "(?s:.*)" if (low, high) == (0, None) else f"(?s:.){{{low},{'' if high is None else high}}}"
    rule = f"{name}[lazy]: /{body}{close}/"
    if rule not in rules:
        rules.append(rule)
    return name


def _xml_parameter(key: str, schema: object, rules: list[str]) -> str:
    head = quoted(f"{PARAMETER}{key}>\n")
    close = quoted(f"\n{PARAMETER_END}\n")
    if isinstance(schema, Mapping):
        choices = schema.get("enum") if isinstance(schema.get("enum"), list) else None
        if choices is None and "const" in schema:
            choices = [schema["const"]]
        if choices and all(isinstance(c, str) for c in choices):
            return f"{head} ({' | '.join(quoted(c) for c in choices)}) {close}"
    if is_text_parameter(schema):
        return f"{head} {_text_value(schema, rules)}"
    body = with_layout(schema) if isinstance(schema, Mapping) else {}
    return f"{head} %json {json.dumps(body, ensure_ascii=False)} {close}"


def _xml_call(tool: Tool, rules: list[str]) -> str:
    required = tool.parameters.get("required")
    required = set(required) if isinstance(required, list) else set()
    params = []
    for key, schema in tool.properties.items():
        part = f"({_xml_parameter(key, schema, rules)})"
        params.append(part if key in required else part + "?")
    head = quoted(f"\n{FUNCTION}{tool.name}>\n")
    return " ".join([head, *params, quoted(f"{FUNCTION_END}\n")])


def tool_call_grammar(
    parser: ToolParser,
    tools: Sequence[Tool],
    choice: ToolChoice,
    parallel: bool = True,
    literal: Literal = quoted,
    answer_schema: Mapping[str, Any] | None = None,
    extra_properties: bool = False,
) -> str | None:
    """The Lark grammar of a reply under ``choice`` (None for ``"none"``: no constraint).

    ``answer_schema`` (``"auto"`` only) constrains the free-text alternative to JSON under that schema
    (a ``response_format`` beside the tools). Parameter and answer schemas are read as OpenAI reads them
    (objects hold only the properties they list) unless ``extra_properties``
    (:mod:`onnxgen.generation.schema_objects`).
    """
    if choice.mode == "none" or not tools:
        return None
    allowed = [t for t in tools if t.name == choice.name] if choice.mode == "named" else list(tools)
    if not extra_properties:
        allowed = [replace(t, parameters=close_objects(t.parameters)) for t in allowed]
        answer_schema = close_objects(answer_schema) if answer_schema is not None else None
    start, end = literal(parser.start_tag), literal(parser.end_tag)
    rules = []
    if parser.name == "hermes":
        rules.append(f"call_body: {_hermes_call(allowed)} {end}")
    else:
        names = [f"fn_{i}" for i in range(len(allowed))]
        rules.append(f"call_body: ({' | '.join(names)}) {end}")
        values: list[str] = []
        rules += [f"{name}: {_xml_call(tool, values)}" for name, tool in zip(names, allowed, strict=True)]
        rules += values
    rules.append(f"call: {start} call_body")
    rules.append(f"calls: call_body {'(SEP call)*' if parallel and choice.mode != 'named' else ''}".rstrip())
    rules.append("SEP: /[ \\t\\r\\n]{0,4}/")
    if choice.forces_call:
        head = ["start: first calls", f"first: {start}"]
    else:
        text = f"%json {json.dumps(with_layout(answer_schema))}" if answer_schema is not None else "TEXT"
        head = ["start: answer | lead calls", f"answer: {text}"]
        head.append(f"TEXT: {free_text(parser.start_tag)}")
        if is_token(start):
            head.append(f"lead: TEXT {start}")
        else:
            head.append(f"lead[lazy]: /(?s:.*){regex_of(parser.start_tag)}/")
    return "\n".join([*head, *rules]) + "\n"
