"""Chat-level protocol logic independent of HTTP: tools, tool-call parsing, reasoning, template messages.

- :mod:`onnxgen.chat.tools`: tool definitions, ``tool_choice``, parsed tool calls.
- :mod:`onnxgen.chat.messages`: OpenAI chat messages made ready for a chat template.
- :mod:`onnxgen.chat.parsers`: tool-call parsers per output format (whole text and streaming).
- :mod:`onnxgen.chat.reasoning`: the ``<think> ... </think>`` split (whole text and streaming).
- :mod:`onnxgen.chat.grammar`: llguidance grammars that guarantee well-formed tool calls.
- :mod:`onnxgen.chat.output`: reasoning and tool calls parsed together from one reply.

Modules here import only :mod:`onnxgen.errors` and each other, so the tokenizer, the generation loop, the
library and the server can all use them.
"""
