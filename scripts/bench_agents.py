"""Fixed work for timing the agent features with farm-bench (whole process, A/B pairs).

    python scripts/bench_agents.py MODEL MODE

Loads MODEL, then makes three 128-token replies:

- ``plain``: greedy generation;
- ``logprobs``: the same with ``logprobs=True, top_logprobs=5``;
- ``chat-free`` / ``chat-grammar``: sampled (temperature 1) chat replies with one tool under
  ``tool_choice="auto"``, the tool-call grammar off / on (``constrain_calls``).
"""

from __future__ import annotations

import sys

import onnxgen
from onnxgen import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def main(model: str, mode: str) -> None:
    llm = onnxgen.load(model, threads=1)
    for seed in range(3):
        if mode in ("plain", "logprobs"):
            extra = {"logprobs": True, "top_logprobs": 5} if mode == "logprobs" else {}
            llm.generate(PROMPT, SamplingParams(max_new_tokens=128, ignore_eos=True, **extra))
        elif mode in ("chat-free", "chat-grammar"):
            params = SamplingParams(max_new_tokens=128, ignore_eos=True, temperature=1.0, seed=seed)
            messages = [{"role": "user", "content": PROMPT}]
            llm.chat(
                messages, params, tools=TOOLS, tool_parser="hermes", constrain_calls=mode == "chat-grammar"
            )
        else:
            raise SystemExit(f"unknown mode {mode!r}; use plain, logprobs, chat-free or chat-grammar")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
