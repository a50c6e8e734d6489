"""The XML-style call format of Qwen3-Coder and Qwen3.5::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text between ``<parameter=KEY>`` and ``</parameter>`` (one newline after the
opening tag and one before the closing tag are layout, not value). Parameters whose schema admits a
string (and parameters the tool does not declare) are taken as text; the others as JSON, kept as text when
they do not parse (as vLLM does). The call's ``arguments`` is the JSON object of the parameters, written
as ``json.dumps`` writes it; text values stream as they arrive.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from onnxgen.chat.calls import DONE, FAILED, OPEN, CallBody
from onnxgen.chat.deltas import partial_suffix
from onnxgen.chat.tools import Tool

START_TAG, END_TAG = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
MAX_NAME = 256  # characters of a function or parameter name before giving up on its closing '>'
_HEAD, _PARAMS, _VALUE, _POST = range(4)


def _types(schema: object) -> set[str]:
    if not isinstance(schema, Mapping):
        return set()
    declared = schema.get("type")
    types = (
        {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else set()
    )
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            types |= _types(option)
    if not types and isinstance(schema.get("enum"), list):
        types = {"string" if isinstance(v, str) else "other" for v in schema["enum"]}
    if not types and "const" in schema:
        types = {"string" if isinstance(schema["const"], str) else "other"}
    return types


def is_text_parameter(schema: object) -> bool:
    """True when a parameter's value is written as plain text: its schema admits a string, or says
    nothing about its type (an undeclared parameter)."""
    types = _types(schema)
    return not types or "string" in types


def parameter_value(raw: str, schema: object) -> Any:
    """The value of a parameter written as ``raw`` (see the module docstring)."""
    if is_text_parameter(schema):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class XmlBody(CallBody):
    """Incremental scanner of ``<function=NAME>`` ... ``</function>`` followed by ``</tool_call>``."""

    def __init__(self, tools: Mapping[str, Tool] | None) -> None:
        super().__init__(tools)
        self._buf = ""
        self._pos = 0
        self._state = _HEAD
        self._args: list[str] = []  # argument pieces ready to stream
        self._params = 0
        self._key = ""
        self._text = False  # the current parameter is text (streams as a JSON string)
        self._value_start = 0
        self._streamed = 0  # end of the text value streamed so far (an index into _buf)

    def take_arguments(self) -> str:
        piece = "".join(self._args)
        self._args.clear()
        return piece

    def finish(self) -> None:
        if self.status == OPEN:
            self.status = DONE if self._state == _POST else FAILED

    def feed(self, text: str) -> None:
        self._buf += text
        while self.status == OPEN and self._advance():
            pass
        self.consumed = self._pos

    def _skip_ws(self) -> None:
        while self._pos < len(self._buf) and self._buf[self._pos] in " \t\r\n":
            self._pos += 1

    def _at(self, tag: str) -> bool | None:
        """True at ``tag``, None when the text so far may still become it, False otherwise."""
        rest = self._buf[self._pos : self._pos + len(tag)]
        if rest == tag:
            return True
        return None if tag.startswith(rest) else False

    def _name_after(self, tag: str) -> str | None:
        """The name between ``tag`` and ``>`` (the position moves past ``>``); None when incomplete."""
        start = self._pos + len(tag)
        end = self._buf.find(">", start)
        if end < 0:
            partial = self._buf[start:]
            if len(partial) > MAX_NAME or "\n" in partial or "<" in partial:
                self.status = FAILED
            return None
        self._pos = end + 1
        return self._buf[start:end]

    def _advance(self) -> bool:
        """One step of the scan; False when more text is needed (or the scan ended)."""
        if self._state == _HEAD:
            return self._head()
        if self._state == _PARAMS:
            return self._next_parameter()
        if self._state == _VALUE:
            return self._value()
        self._skip_ws()
        at_end = self._at(END_TAG)
        if at_end:
            self._pos += len(END_TAG)
            self.status = DONE
        elif at_end is False:
            self.status = FAILED
        return False

    def _head(self) -> bool:
        self._skip_ws()
        at = self._at(FUNCTION)
        if not at:
            self.status = FAILED if at is False else OPEN
            return False
        name = self._name_after(FUNCTION)
        if name is None:
            return False
        if not self.known(name):
            self.status = FAILED
            return False
        self.name = name
        self._args.append("{")
        self._state = _PARAMS
        return True

    def _next_parameter(self) -> bool:
        self._skip_ws()
        if self._at(FUNCTION_END):
            self._pos += len(FUNCTION_END)
            self._args.append("}")
            self._state = _POST
            return True
        at = self._at(PARAMETER)
        if not at:
            if at is False and self._at(FUNCTION_END) is False:
                self.status = FAILED
            return False
        start = self._pos
        key = self._name_after(PARAMETER)
        if key is None:
            return False
        if self._pos >= len(self._buf):  # the next character tells whether a layout newline follows
            self._pos = start
            return False
        if self._buf[self._pos] == "\n":
            self._pos += 1
        self._key = key
        schema = self.tools[self.name].properties.get(key) if self.tools and self.name else None
        self._text = is_text_parameter(schema)
        self._args.append((", " if self._params else "") + json.dumps(key, ensure_ascii=False) + ": ")
        if self._text:
            self._args.append('"')
        self._params += 1
        self._value_start = self._streamed = self._pos
        self._state = _VALUE
        return True

    def _value(self) -> bool:
        end = self._buf.find(PARAMETER_END, max(self._value_start, self._pos - len(PARAMETER_END)))
        if end < 0:
            if self._text:  # stream what cannot be the layout newline or the closing tag
                tail = self._buf[max(self._value_start, len(self._buf) - len(PARAMETER_END)) :]
                hold = max(partial_suffix(tail, "\n" + PARAMETER_END), partial_suffix(tail, PARAMETER_END))
                self._stream_text(len(self._buf) - hold)
            self._pos = len(self._buf)
            return False
        stop = end - 1 if end > self._value_start and self._buf[end - 1] == "\n" else end
        if self._text:
            self._stream_text(stop)
            self._args.append('"')
        else:
            schema = self.tools[self.name].properties.get(self._key) if self.tools and self.name else None
            value = parameter_value(self._buf[self._value_start : stop], schema)
            self._args.append(json.dumps(value, ensure_ascii=False))
        self._pos = end + len(PARAMETER_END)
        self._state = _PARAMS
        return True

    def _stream_text(self, upto: int) -> None:
        if upto > self._streamed:
            self._args.append(json.dumps(self._buf[self._streamed : upto], ensure_ascii=False)[1:-1])
            self._streamed = upto
