"""The workloads of ``onnxgen bench --workload``: what a user sends, as OpenAI chat messages.

- ``chat``: one conversation of fixed user messages; each reply is generated greedily and appended, and
  every turn sends the whole history (as a client of the OpenAI chat API does);
- ``code-edit``: a ~140-line Python file from the standard library (``json.decoder``) and an instruction to
  rename one variable and return the whole file, so the reply repeats most of the prompt; one request per
  edit, each on the same file;
- ``rag``: ~1.4k tokens of the standard library's ``json`` documentation, then one question; one request per
  question, each on the same document.

Each round starts every conversation with a system message naming the round, so nothing a cache kept from
an earlier round (or the warm-up) matches past the first few tokens: the first request of a round is cold,
the later ones may reuse what the earlier ones left. Only the standard library is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass

WORKLOADS = ("chat", "code-edit", "rag")
# tokens generated at most per request (the model may stop earlier at its end-of-sequence token)
DEFAULT_MAX_TOKENS = {"chat": 96, "code-edit": 256, "rag": 128}

CHAT_TURNS = (
    "Hi! I'm planning a week-long trip to Japan in April. What should I know before I go?",
    "Which cities would you suggest for a first visit, and how many days should I spend in each?",
    "How do I get from Tokyo to Kyoto, and roughly how long does it take?",
    "What are some foods I should try, especially in Osaka?",
    "I don't speak Japanese. Which phrases are the most useful for a traveller?",
    "Is it better to carry cash or to pay by card there?",
    "What etiquette should I keep in mind when visiting temples and shrines?",
    "Can you suggest a one-day itinerary for Kyoto?",
    "What should I pack for the weather in April?",
    "Thanks! Can you sum up the whole plan as a short list?",
)

# (variable, new name): each names a variable of CODE_EDIT_FUNCTIONS
RENAMES = (("chunks", "parts"), ("nextchar", "next_char"), ("pairs", "members"), ("memo", "key_cache"))
CODE_EDIT_FUNCTIONS = ("py_scanstring", "JSONObject")

QUESTIONS = (
    "What does the sort_keys argument of json.dumps do?",
    "How do you get the most compact JSON representation?",
    "What happens when skipkeys is false and a dict key is not a basic type?",
    "Which argument lets you serialize objects that json does not know how to encode?",
)


@dataclass(frozen=True)
class Conversation:
    """The user messages of one conversation after a system message; ``keep_history``: each turn sends
    the earlier turns and their replies too (else each message is a conversation of its own)."""

    system: str
    user: tuple[str, ...]
    keep_history: bool


def code_file() -> str:
    """The file the code-edit workload edits: two functions of ``json.decoder``."""
    import inspect
    import json.decoder

    return "\n\n".join(inspect.getsource(getattr(json.decoder, name)) for name in CODE_EDIT_FUNCTIONS)


def document() -> str:
    """The document the rag workload answers over: the ``json`` module's and ``json.dumps``' docstrings."""
    import json

    docs = [json.__doc__, json.dumps.__doc__]
    if not all(docs):
        raise RuntimeError(
            "the rag workload reads the json module's docstrings, which this Python strips (-OO or "
            "PYTHONOPTIMIZE=2); run without it"
        )
    return "\n\n".join(d for d in docs if d)


def build(workload: str, round_index: int, *, turns: int, edits: int, questions: int) -> Conversation:
    """The conversation(s) of ``workload`` for one round (``round_index`` < 0: the warm-up's)."""
    system = f"Session {round_index}. You are a helpful assistant."
    if workload == "chat":
        return Conversation(system, _take(CHAT_TURNS, turns, "--chat-turns"), keep_history=True)
    if workload == "code-edit":
        code = code_file()
        asks = tuple(
            f"Here is a Python file:\n```python\n{code}```\n\nRename the variable `{old}` to `{new}` "
            "everywhere in this file. Reply with the whole updated file and nothing else."
            for old, new in _take(RENAMES, edits, "--edits")
        )
        return Conversation(system, asks, keep_history=False)
    if workload == "rag":
        doc = document()
        asks = tuple(
            f"Answer the question using the documentation below.\n\n{doc}\n\nQuestion: {q}"
            for q in _take(QUESTIONS, questions, "--questions")
        )
        return Conversation(system, asks, keep_history=False)
    raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")


def _take(items: tuple, n: int, flag: str) -> tuple:
    if not 1 <= n <= len(items):
        raise ValueError(f"{flag} must be between 1 and {len(items)} (got {n})")
    return items[:n]
