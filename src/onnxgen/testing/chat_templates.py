"""Small chat templates in the style of Qwen's, with tools and thinking, for tests.

- :data:`HERMES_TEMPLATE` (Qwen3 style): tools listed in the system turn, calls written as
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, tool results sent back in a user turn
  inside ``<tool_response>``; the model opens ``<think>`` itself, and ``enable_thinking=False`` writes an
  empty thinking section into the prompt.
- :data:`XML_TEMPLATE` (Qwen3.5 / Qwen3-Coder style): calls written as
  ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``;
  the generation prompt opens ``<think>\\n``, so only ``</think>`` appears in the output.

Both render assistant tool calls from argument objects (``tool_call.arguments``), as the real ones do.
"""

from __future__ import annotations

import json
from pathlib import Path

_SYSTEM_AND_TOOLS = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nFunctions you may call, inside <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\n' + CALL_HELP + '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
"""

_TOOL_RESULTS = """\
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
"""

_TURNS = """\
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
REASONING
{{- message.content if message.content is string else '' }}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function if call.function is defined else call %}
{{- '\\n' if (message.content or not loop.first) else '' }}
CALL
{%- endfor %}
{{- '<|im_end|>\\n' }}
"""

_GENERATION = """\
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
OPEN_THINKING{%- endif %}
{%- endif %}
"""


def _template(call_help: str, reasoning: str, call: str, open_thinking: str) -> str:
    """The template of one call format: how a past assistant turn shows its reasoning and its calls, and
    what the generation prompt writes when thinking is on."""
    head = "{%- set CALL_HELP = '" + call_help + "' %}\n"
    turns = _TURNS.replace("REASONING", reasoning).replace("CALL", call)
    return (
        head + _SYSTEM_AND_TOOLS + turns + _TOOL_RESULTS + _GENERATION.replace("OPEN_THINKING", open_thinking)
    )


HERMES_TEMPLATE = _template(
    call_help='To call a function, reply with <tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call>",
    reasoning="{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}",
    call="""{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{{- call.arguments if call.arguments is string else call.arguments | tojson }}
{{- '}\\n</tool_call>' }}""",
    open_thinking="",
)

XML_TEMPLATE = _template(
    call_help="To call a function, reply with <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n"
    "</parameter>\\n</function>\\n</tool_call>",
    reasoning="{{- '<think>\\n' + (message.reasoning_content or '') + '\\n</think>\\n\\n' }}",
    call="""{{- '<tool_call>\\n<function=' + call.name + '>\\n' }}
{%- for key, value in call.arguments | items %}
{{- '<parameter=' + key + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}""",
    open_thinking="{%- else %}{{- '<think>\\n' }}",
)

TAG_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def install_chat_template(model_dir: str | Path, template: str, tag_tokens: bool = True) -> None:
    """Give a tiny model built by :func:`onnxgen.testing.build_model` the chat ``template``; with
    ``tag_tokens`` the first reserved ids become the tokens ``<think>``, ``</think>``, ``<tool_call>`` and
    ``</tool_call>`` (added, not special, as in Qwen's tokenizers), so tags are single tokens.

    Needs a vocabulary with reserved ids (``TinySpec(vocab_size=1024)`` or more)."""
    directory = Path(model_dir)
    (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    if not tag_tokens:
        return
    path = directory / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    reserved = [t for t in data["added_tokens"] if t["content"].startswith("<|reserved_")]
    if len(reserved) < len(TAG_TOKENS):
        raise ValueError(f"{path} has {len(reserved)} reserved ids; build the model with a larger vocab_size")
    for entry, tag in zip(reserved, TAG_TOKENS, strict=False):
        entry.update(content=tag, special=False)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
