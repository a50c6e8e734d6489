"""The tokens the next turn of a conversation will start with, once a reply is appended to it.

A chat renders the whole conversation through its template each turn, and the prompt is the rendered
text tokenized. The reply the model generated comes back into that text as its decoded string, and a
byte-level BPE tokenizer need not encode that string to the ids the model produced (a trained model's
replies usually round-trip; a random-weight model's almost never do): the next prompt holds the canonical
ids of the reply, and the prefix cache, which holds the generated ones, matches only up to the first id
where the two part. The next prompt also holds the template's end-of-turn tokens after the reply, which
no forward has run yet.

:func:`next_turn_prefix` gives the ids the next prompt is known to start with: the conversation with the
reply appended and a new user message after it, rendered twice with two different messages, tokenized
as the prompt is; the ids the two renderings share end just before the new message's text. Running
those ids into the cache after a reply (``LLM.chat``) lets the next turn prefill its new message only,
while the model is fed exactly the tokens it is fed without a cache. Nothing is assumed about the
template: the next turn's lookup compares token ids, and a conversation continued otherwise (another
message appended, a template that drops the reply's reasoning once a new message follows) resumes from
what does match.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from onnxgen.chat.tools import Tool
from onnxgen.tokenizer import Tokenizer

# two user messages whose first characters differ in class (a letter, a digit): no tokenizer merges
# the text before them with both in the same way
_PROBES = ("Hello", "0")


def next_turn_prefix(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    reply: Mapping[str, Any],
    tools: Sequence[Tool] = (),
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids every next prompt of ``messages`` + ``reply`` + a user message starts with, rendered
    as a chat prompt is (the same ``tools`` and template variables)."""
    kwargs = dict(template_kwargs or {})
    renders = []
    for probe in _PROBES:
        chat = [*messages, reply, {"role": "user", "content": probe}]
        text = tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tools=list(tools) or None, **kwargs
        )
        renders.append(tokenizer.encode(text, add_special_tokens=False))
    first, second = renders
    common = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        common += 1
    return first[:common]
