"""The I/O roles one source (declared metadata or genai_config) states, by port name: its :class:`Plan`.

A role a source does not state stays unset (``UNSET``) and is derived from the graph; a role a source
states as absent (``None``, e.g. ``position_ids_input: null``) is absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onnxgen.model.io import IOSource, Shape
from onnxgen.model.naming import KVNames, StateNames


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()
Role = str | None | _Unset


@dataclass(frozen=True)
class StaticNames:
    """The extra inputs of a static KV cache: write indices and (optional) live lengths per row."""

    write_indices: str
    kv_lengths: str | None = None


@dataclass
class Plan:
    source: IOSource
    origin: str  # where the statements came from, for messages (e.g. "inference_metadata.yaml model.io")
    token_input: Role = UNSET
    attention_mask: Role = UNSET
    position_ids: Role = UNSET
    logits: Role = UNSET
    kv: list[KVNames] | None = None
    states: list[StateNames] | None = None
    static: StaticNames | None = None  # stated with static-layout KV pairs
    # Declared port shapes/dtypes that must match the graph exactly (declared source only).
    shapes: dict[str, Shape] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    # Roles whose port may be missing from the graph (genai_config lists ports a graph may not have).
    optional_roles: frozenset[str] = frozenset()
    notes: list[str] = field(default_factory=list)

    def stated(self, role: str) -> bool:
        return not isinstance(getattr(self, role), _Unset)


def graph_plan() -> Plan:
    return Plan(source="graph", origin="the graph")
