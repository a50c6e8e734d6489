"""The constraints ``onnxgen bench --constraint`` times: one per kind, none of which can end early.

Each keeps a greedy decoder busy for thousands of tokens (so a run always generates ``--new-tokens``
tokens), and mixes the states that cost llguidance differently: JSON between values (few tokens
allowed) and inside strings and numbers (many), a character class that admits most of a vocabulary, and
a Lark grammar with nested expressions.
"""

from __future__ import annotations

from typing import Any

_ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "score": {"type": "number"},
    },
    "required": ["id", "name", "kind", "score"],
    "additionalProperties": False,
}
_GRAMMAR = r"""
start: stmt{32,}
stmt: NAME " = " expr ";\n"
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | NAME | "(" expr ")"
NAME: /[a-z]{1,6}/
NUMBER: /[0-9]{1,4}/
"""

CONSTRAINTS: dict[str, dict[str, Any]] = {
    "json_schema": {"json_schema": {"type": "array", "items": _ITEM, "minItems": 64}},
    "regex": {"regex": r"([a-z]{1,8} ){200}"},
    "grammar": {"grammar": _GRAMMAR},
}


def constraint_kwargs(name: str) -> dict[str, Any]:
    """SamplingParams keyword arguments of the built-in constraint ``name``."""
    try:
        return CONSTRAINTS[name]
    except KeyError:
        raise ValueError(
            f"--constraint: unknown constraint {name!r}; choose from {', '.join(CONSTRAINTS)}"
        ) from None
