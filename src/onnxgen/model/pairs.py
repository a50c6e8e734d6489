"""KV pairs and state pairs: pairing past inputs with present outputs, checking and sizing them.

Graph rules (used for whatever the declared metadata / genai_config do not state):

1. A past-like input ``<past prefix>.N.<suffix>`` (prefixes ``past_key_values``, ``past_key_value``,
   ``past_state(s)``, ``past``; separator ``.`` or ``_``) pairs with the present-like output of the same
   layer and suffix (prefixes ``present_key_values``, ``present_key_value``, ``present_state(s)``,
   ``present``): ``past_key_values.3.key`` -> ``present.3.key``, ``past.0.conv`` -> ``present.0.conv``.
2. Suffix ``key``/``value`` (``k``/``v``) makes a KV pair, needing both at one layer; every other suffix
   makes a state pair (kind ``conv``, ``recurrent`` or ``state`` by name). KV ports are never states.
3. A past without its present, a present without its past, or two ports claiming one (layer, suffix)
   is an error naming them.

Checks (every source): dtypes of the two sides must be equal; a concrete extent that differs between
the sides is an error, a symbolic one is a wildcard. A state's non-batch extents must be static on at
least one side (taken from whichever side is static).
"""

from __future__ import annotations

from collections.abc import Iterable

from onnxgen.errors import AmbiguousIOError, DecoderIOError
from onnxgen.model.graph_ports import GraphSignature
from onnxgen.model.io import Dim, Port, Shape, StatePair
from onnxgen.model.naming import KVNames, StateNames, kv_role, parse_past, parse_present, state_kind


def _index(ports: Iterable[Port], parse: object, claimed: set[str]) -> dict[tuple[int, str], str]:
    out: dict[tuple[int, str], str] = {}
    for p in ports:
        parsed = parse(p.name) if p.name not in claimed else None  # type: ignore[operator]
        if parsed is None:
            continue
        if parsed in out:
            raise AmbiguousIOError(
                f"ports '{out[parsed]}' and '{p.name}' both claim layer {parsed[0]} '{parsed[1]}'; declare the "
                "pairs in inference_metadata.yaml (model.io kv_inputs/kv_outputs or state_pairs)"
            )
        out[parsed] = p.name
    return out


def pair_by_name(sig: GraphSignature, claimed: set[str]) -> tuple[list[KVNames], list[StateNames]]:
    """Apply graph rules 1-3 to the ports not in ``claimed``."""
    pasts = _index(sig.inputs, parse_past, claimed)
    presents = _index(sig.outputs, parse_present, claimed)
    unpaired = sorted(n for k, n in pasts.items() if k not in presents)
    if unpaired:
        raise DecoderIOError(
            f"past input(s) {', '.join(unpaired)} have no matching present output (e.g. present.N.<same suffix>); "
            "declare the pairs in inference_metadata.yaml model.io"
        )
    orphans = sorted(n for k, n in presents.items() if k not in pasts)
    if orphans:
        raise DecoderIOError(
            f"present output(s) {', '.join(orphans)} have no matching past input; declare the pairs in "
            "inference_metadata.yaml model.io"
        )
    keys: dict[int, tuple[str, str]] = {}
    values: dict[int, tuple[str, str]] = {}
    states: list[StateNames] = []
    for (layer, suffix), past in pasts.items():
        role = kv_role(suffix)
        if role is None:
            states.append(StateNames(past, presents[(layer, suffix)], layer, state_kind(suffix)))
        else:
            (keys if role == "key" else values)[layer] = (past, presents[(layer, suffix)])
    lonely = sorted(set(keys) ^ set(values))
    if lonely:
        names = [(keys.get(i) or values[i])[0] for i in lonely]
        raise DecoderIOError(f"KV input(s) {', '.join(names)} have no key/value partner at the same layer")
    kv = [KVNames(i, keys[i][0], values[i][0], keys[i][1], values[i][1]) for i in sorted(keys)]
    return kv, sorted(states, key=lambda s: (s.layer if s.layer is not None else -1, s.kind, s.input))


def _show(shape: Shape) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def check_compatible(past: Port, present: Port, *, seq_axis: int | None = None) -> None:
    """Same dtype; same rank when both are known; equal extents where both are concrete (except on
    ``seq_axis``, the KV sequence axis, where past and present lengths differ by design)."""
    if past.dtype != present.dtype:
        raise DecoderIOError(
            f"'{past.name}' is {past.dtype} but its present '{present.name}' is {present.dtype}; "
            "they must have one dtype (re-export, or declare other pairs in inference_metadata.yaml model.io)"
        )
    if not (past.rank_known and present.rank_known):
        return
    if past.rank != present.rank or any(
        i != seq_axis and isinstance(a, int) and isinstance(b, int) and a != b
        for i, (a, b) in enumerate(zip(past.shape, present.shape, strict=False))
    ):
        raise DecoderIOError(
            f"'{past.name}' {_show(past.shape)} and its present '{present.name}' {_show(present.shape)} "
            "differ in a concrete extent; they cannot be paired"
        )


def state_pair(names: StateNames, past: Port, present: Port) -> StatePair:
    """A checked :class:`StatePair`; its shape is ``("batch", static extents...)``."""
    check_compatible(past, present)
    ref = past if past.rank_known else present
    if not ref.rank_known or ref.rank == 0:
        raise DecoderIOError(
            f"state '{past.name}' / '{present.name}' has no shape in the graph; declare its shape in "
            "inference_metadata.yaml model.io state_pairs (shape: [batch, ...])"
        )
    other = present.shape if present.rank_known else past.shape
    dims: list[Dim] = ["batch"]
    for axis in range(1, ref.rank):
        a, b = ref.shape[axis], other[axis]
        static = a if isinstance(a, int) else b if isinstance(b, int) else None
        if static is None:
            raise DecoderIOError(
                f"state '{past.name}' {_show(past.shape)} / '{present.name}' {_show(present.shape)} has no static "
                f"extent on axis {axis}; a state buffer needs a fixed shape: declare it in inference_metadata.yaml "
                "model.io state_pairs (shape: [batch, ...])"
            )
        dims.append(static)
    return StatePair(names.input, names.output, tuple(dims), past.dtype, names.layer, names.kind)
