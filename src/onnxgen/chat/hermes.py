"""The Hermes / Qwen JSON call format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Used by Qwen2.5, Qwen3 (and Qwen3-Next), Hermes and many fine-tunes. The body is scanned one character at
a time, tracking strings, escapes and nesting, so braces inside strings and nested objects never end a
value early. The arguments object streams as the model writes it: the call's ``arguments`` is the text of
that object (``"parameters"`` is accepted for ``"arguments"``, and arguments given as a JSON string
holding an object are unwrapped).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from onnxgen.chat.calls import DONE, FAILED, OPEN, CallBody
from onnxgen.chat.tools import Tool

START_TAG, END_TAG = "<tool_call>", "</tool_call>"
_WS = " \t\r\n"
_ARGUMENT_KEYS = ("arguments", "parameters")

# scanner states
_PRE, _MEMBER, _KEY, _COLON, _VALUE_START, _VALUE, _AFTER, _POST = range(8)


class HermesBody(CallBody):
    """Incremental scanner of ``{"name": ..., "arguments": ...}`` followed by ``</tool_call>``."""

    def __init__(self, tools: Mapping[str, Tool] | None) -> None:
        super().__init__(tools)
        self._state = _PRE
        self._key: list[str] = []
        self._member = ""  # the key of the member whose value is being scanned
        self._value: list[str] = []
        self._kind = ""  # first character of the value: '{', '[', '"' or a scalar's
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._args: list[str] | None = None  # arguments text known so far (streams while it grows)
        self._args_final = False
        self._taken = 0  # pieces of _args streamed
        self._tag = 0  # characters of the end tag matched
        self._members = 0

    def take_arguments(self) -> str:
        if self._args is None:
            if self.status != DONE:
                return ""
            self._args, self._args_final = ["{}"], True  # no arguments member: a call without arguments
        piece = "".join(self._args[self._taken :])
        self._taken = len(self._args)
        return piece

    def finish(self) -> None:
        if self.status == OPEN:
            self.status = DONE if self._state == _POST else FAILED

    def feed(self, text: str) -> None:
        for char in text:
            if self.status != OPEN:
                return
            self._step(char)
            if self.status != FAILED:
                self.consumed += 1  # a fault leaves ``consumed`` at the faulty character

    def _fail(self) -> None:
        self.status = FAILED

    def _step(self, char: str) -> None:
        state = self._state
        if state == _VALUE:
            self._value_char(char)
        elif state == _KEY:
            self._key_char(char)
        elif char in _WS and state != _POST:
            return
        elif state == _PRE:
            self._expect(char, "{", _MEMBER)
        elif state == _MEMBER:
            if char == '"':
                self._state, self._key, self._escape = _KEY, [], False
            elif char == "}" and self._members == 0:
                self._close_object()
            else:
                self._fail()
        elif state == _COLON:
            self._expect(char, ":", _VALUE_START)
        elif state == _VALUE_START:
            self._start_value(char)
        elif state == _AFTER:
            if char == ",":
                self._state = _MEMBER
            elif char == "}":
                self._close_object()
            else:
                self._fail()
        else:
            self._end_tag_char(char)

    def _expect(self, char: str, wanted: str, then: int) -> None:
        if char == wanted:
            self._state = then
        else:
            self._fail()

    def _key_char(self, char: str) -> None:
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            try:
                self._member = json.loads('"' + "".join(self._key) + '"')
            except ValueError:
                self._fail()
                return
            self._state = _COLON
            return
        self._key.append(char)

    def _start_value(self, char: str) -> None:
        self._members += 1
        self._kind, self._value, self._depth, self._in_string, self._escape = char, [], 0, False, False
        if self._member in _ARGUMENT_KEYS:
            if self._args is not None or char not in '{"':
                self._fail()  # arguments twice, or neither an object nor a string holding one
                return
            if char == "{":
                self._args = []
        self._state = _VALUE
        self._value_char(char)

    def _value_char(self, char: str) -> None:
        """One character of the current value; a scalar ends at the first character that is not its own."""
        kind = self._kind
        if kind not in '{["' and (char in _WS or char in ",}"):
            self._end_value()
            if self.status == OPEN:
                self._step(char)  # the delimiter belongs to the object
            return
        self._value.append(char)
        if kind == "{" and self._args is not None and not self._args_final:
            self._args.append(char)
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                if kind == '"' and self._depth == 0:
                    self._end_value()
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._end_value()

    def _end_value(self) -> None:
        raw = "".join(self._value)
        self._state = _AFTER
        try:
            value = json.loads(raw)
        except ValueError:
            self._fail()
            return
        if self._member == "name":
            if self.name is not None or not isinstance(value, str) or not self.known(value):
                self._fail()
                return
            self.name = value
        elif self._member in _ARGUMENT_KEYS:
            if isinstance(value, str):  # arguments as JSON text inside a string
                try:
                    inner = json.loads(value)
                except ValueError:
                    inner = None
                if not isinstance(inner, dict):
                    self._fail()
                    return
                self._args = [value]
            elif not isinstance(value, dict):
                self._fail()
                return
            self._args_final = True

    def _close_object(self) -> None:
        if self.name is None:
            self._fail()
            return
        self._state = _POST

    def _end_tag_char(self, char: str) -> None:
        if self._tag == 0 and char in _WS:
            return
        if char != END_TAG[self._tag]:
            self._fail()
            return
        self._tag += 1
        if self._tag == len(END_TAG):
            self.status = DONE
