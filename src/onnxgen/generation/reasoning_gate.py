"""A constraint that starts after a reasoning section: the thinking is free, the answer is constrained.

The grammar of the answer (llguidance's JSON form: a JSON schema, regex or Lark grammar) becomes the
subgrammar ``@answer`` of a small Lark grammar that first takes the section. The thinking may not spell
the end tag, so the section ends exactly where :mod:`onnxgen.chat.reasoning` splits it. When the end
tag is a special token of the tokenizer, the grammar names the token (llguidance cannot spell special
tokens); ``literal`` gives that syntax.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from onnxgen.generation.params import ReasoningSection

Literal = Callable[[str], str]


def quoted(text: str) -> str:
    """Lark syntax of a fixed text as a string literal."""
    return json.dumps(text, ensure_ascii=False)


def after_reasoning(grammar: str, section: ReasoningSection, literal: Literal = quoted) -> str:
    """``grammar`` (llguidance's JSON form) as the answer after a free reasoning section."""
    start, end = literal(section.start), literal(section.end)
    end_text = re.escape(section.end).replace("/", "\\/")
    lines = []
    if section.opened:
        lines.append("start: reasoning WS? answer")
    else:
        lines.append("start: (WS? open_tag reasoning WS?)? answer")
        lines.append(f"open_tag: {start}")
    if end.startswith("<["):  # a special token ends the section: free text (never spelling it), then it
        lines.append(f"reasoning: REASONING {end}")
        lines.append(f"REASONING: /(?s:.*)/ & ~/(?s:.*){end_text}(?s:.*)/")
    else:  # the first spelled end tag ends the section
        lines.append(f"reasoning[lazy]: /(?s:.*){end_text}/")
    lines += ["WS: /[ \\t\\r\\n]+/", "answer: @answer"]
    # grammar_from_lark returns the Lark text itself; the other forms are {"grammars": [...]}
    inner = (
        json.loads(grammar)["grammars"] if grammar.lstrip().startswith("{") else [{"lark_grammar": grammar}]
    )
    inner[0] = {**inner[0], "name": "answer"}
    return json.dumps({"grammars": [{"lark_grammar": "\n".join(lines) + "\n"}, *inner]})
