"""Port-name conventions: past/present names with a layer index, and ``%d`` name templates."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_PAST = re.compile(r"^(?:past_key_values|past_key_value|past_states?|past)[._](\d+)[._](.+)$")
_PRESENT = re.compile(r"^(?:present_key_values|present_key_value|present_states?|present)[._](\d+)[._](.+)$")
# GPT-2 style stacked caches: one port per layer, key and value stacked on axis 0.
_STACKED_PAST = re.compile(r"^(?:past_key_values|past)[._](\d+)$")
_STACKED_PRESENT = re.compile(r"^(?:present_key_values|present)[._](\d+)$")
# Static caches (mobius --static-cache): key_cache.N -> updated_key_cache.N.
_STATIC_PAST = re.compile(r"^(key|value)_cache[._](\d+)$")
_STATIC_PRESENT = re.compile(r"^(?:updated|present)_(key|value)_cache[._](\d+)$")
_KEY = {"key", "k", "keys"}
_VALUE = {"value", "v", "values"}


@dataclass(frozen=True)
class KVNames:
    """The four port names of one attention layer's cache."""

    layer: int
    past_key: str
    past_value: str
    present_key: str
    present_value: str
    layout: str = "BNSH"  # "stacked": past_key == past_value (one port), "static": fixed-length buffers


@dataclass(frozen=True)
class StateNames:
    """One recurrent-state pair: input fed each step, output that replaces it."""

    input: str
    output: str
    layer: int | None
    kind: str


def parse_past(name: str) -> tuple[int, str] | None:
    """``past_key_values.3.key`` -> (3, "key"); ``None`` when the name is not past-like."""
    m = _PAST.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def parse_present(name: str) -> tuple[int, str] | None:
    """``present.3.conv_state`` -> (3, "conv_state"); ``None`` when the name is not present-like."""
    m = _PRESENT.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def parse_stacked(name: str, present: bool = False) -> int | None:
    """``past_3`` (or ``present_3`` with ``present``) -> 3: a GPT-2 style stacked KV port's layer."""
    m = (_STACKED_PRESENT if present else _STACKED_PAST).match(name)
    return int(m.group(1)) if m else None


def parse_static(name: str, present: bool = False) -> tuple[int, str] | None:
    """``key_cache.3`` (``updated_key_cache.3`` with ``present``) -> (3, "key"): a static cache port."""
    m = (_STATIC_PRESENT if present else _STATIC_PAST).match(name)
    return (int(m.group(2)), m.group(1)) if m else None


def parse_cache_name(name: str) -> tuple[int, str] | None:
    return parse_past(name) or parse_present(name)


def kv_role(suffix: str) -> str | None:
    """``"key"``/``"value"`` for a KV suffix, ``None`` for anything else (a state)."""
    s = suffix.lower()
    if s in _KEY:
        return "key"
    if s in _VALUE:
        return "value"
    return None


def state_kind(name: str) -> str:
    """``"conv"``, ``"recurrent"`` or ``"state"`` from a state port's name."""
    low = name.lower()
    if "conv" in low:
        return "conv"
    if "recurrent" in low or "ssm" in low:
        return "recurrent"
    return "state"


def layer_of(name: str) -> int | None:
    parsed = parse_cache_name(name)
    return parsed[0] if parsed else None


def template_regex(template: str) -> re.Pattern[str]:
    """``past.%d.conv`` -> a regex whose group 1 is the layer index."""
    if template.count("%d") != 1:
        raise ValueError(f"name template {template!r} must contain exactly one %d")
    head, tail = template.split("%d")
    return re.compile(f"^{re.escape(head)}(\\d+){re.escape(tail)}$")


def template_layers(template: str, names: Iterable[str]) -> list[int]:
    """Layer indices ``i`` for which ``template % i`` is one of ``names`` (sorted)."""
    rx = template_regex(template)
    return sorted({int(m.group(1)) for n in names if (m := rx.match(n))})


def expand(template: str, layer: int) -> str:
    return template.replace("%d", str(layer))
