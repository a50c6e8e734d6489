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
4. GPT-2 style stacked caches: ``past_N`` -> ``present_N`` (also ``past_key_values_N``), rank 5
   ``[2, batch, kv_heads, seq, head_dim]``: one KV pair of layout ``stacked`` (:func:`special_kv_by_name`).
5. Static caches (mobius ``--static-cache``): ``key_cache.N`` / ``value_cache.N`` -> ``updated_key_cache.N``
   / ``updated_value_cache.N``, fed with a ``write_indices`` input (and ``nonpad_kv_seqlen`` when the graph
   has it): KV pairs of layout ``static``.

Checks (every source): dtypes of the two sides must be equal; a concrete extent that differs between
the sides is an error, a symbolic one is a wildcard. A state's non-batch extents must be static on at
least one side (taken from whichever side is static).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from onnxgen.errors import AmbiguousIOError, DecoderIOError
from onnxgen.model.graph_ports import GraphSignature
from onnxgen.model.io import Dim, Port, Shape, StatePair
from onnxgen.model.naming import (
    KVNames,
    StateNames,
    kv_role,
    parse_past,
    parse_present,
    parse_stacked,
    parse_static,
    state_kind,
)
from onnxgen.model.stated_io import StaticNames

WRITE_INDICES = "write_indices"
KV_LENGTHS = "nonpad_kv_seqlen"


def _index(
    ports: Iterable[Port], parse: Callable[[str], tuple[int, str] | None], claimed: set[str]
) -> dict[tuple[int, str], str]:
    out: dict[tuple[int, str], str] = {}
    for p in ports:
        parsed = parse(p.name) if p.name not in claimed else None
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
        raise DecoderIOError(
            f"KV input(s) {', '.join(names)} have no key/value partner at the same layer: a key-only (or "
            "value-only) cache, which onnxgen does not run (it feeds a key and a value cache per attention layer)"
        )
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


def _stacked(sig: GraphSignature, claimed: set[str]) -> list[KVNames]:
    """Rule 4: ``past_N`` inputs of rank 5 with a leading 2 (or unknown) extent and their ``present_N``."""
    found: list[KVNames] = []
    presents = {parse_stacked(p.name, present=True): p.name for p in sig.outputs if p.name not in claimed}
    for port in sig.inputs:
        layer = parse_stacked(port.name) if port.name not in claimed else None
        if layer is None or not port.rank_known or port.rank != 5:
            continue
        if isinstance(port.shape[0], int) and port.shape[0] != 2:
            continue
        present = presents.get(layer)
        if present is None:
            raise DecoderIOError(
                f"stacked KV input '{port.name}' has no matching present output (present_{layer}); declare the "
                "pair in genai_config.json model.decoder (past_names / present_names)"
            )
        found.append(KVNames(layer, port.name, port.name, present, present, layout="stacked"))
    return sorted(found, key=lambda k: k.layer)


def _static(sig: GraphSignature, claimed: set[str]) -> tuple[list[KVNames], StaticNames | None]:
    """Rule 5: ``key_cache.N`` / ``value_cache.N`` buffers, their updated outputs and the write indices."""
    pasts: dict[tuple[int, str], str] = {}
    presents: dict[tuple[int, str], str] = {}
    for port in sig.inputs:
        if port.name not in claimed and (key := parse_static(port.name)) is not None:
            pasts[key] = port.name
    for port in sig.outputs:
        if port.name not in claimed and (key := parse_static(port.name, present=True)) is not None:
            presents[key] = port.name
    if not pasts:
        return [], None
    missing = sorted(n for k, n in pasts.items() if k not in presents)
    if missing:
        raise DecoderIOError(
            f"static cache input(s) {', '.join(missing)} have no updated_*_cache output; declare the caches in "
            "inference_metadata.yaml model.io static_cache"
        )
    layers = sorted({layer for layer, _ in pasts})
    lonely = [layer for layer in layers if (layer, "key") not in pasts or (layer, "value") not in pasts]
    if lonely:
        raise DecoderIOError(
            f"static cache layer(s) {lonely} have a key buffer without a value buffer (or the reverse): a "
            "key-only cache, which onnxgen does not run"
        )
    if sig.input(WRITE_INDICES) is None:
        raise DecoderIOError(
            f"the graph has static cache inputs ({pasts[(layers[0], 'key')]}, ...) but no '{WRITE_INDICES}' input; "
            "declare the write-index input in inference_metadata.yaml model.io static_cache.write_indices_input"
        )
    kv = [
        KVNames(
            layer,
            pasts[(layer, "key")],
            pasts[(layer, "value")],
            presents[(layer, "key")],
            presents[(layer, "value")],
            layout="static",
        )
        for layer in layers
    ]
    lengths = KV_LENGTHS if sig.input(KV_LENGTHS) is not None else None
    return kv, StaticNames(WRITE_INDICES, lengths)


def special_kv_by_name(sig: GraphSignature, claimed: set[str]) -> tuple[list[KVNames], StaticNames | None]:
    """Rules 4 and 5: stacked and static KV pairs found by name among the ports not in ``claimed``."""
    static, names = _static(sig, claimed)
    return _stacked(sig, claimed) + static, names
