"""derive_io: one :class:`DecoderIO` per model, from declared metadata, genai_config or the graph.

Precedence, per role: ``inference_metadata`` ``model.io`` (declared) > ``genai_config.json`` name
templates > the graph rules. A role the chosen source does not state is derived from the graph
(``DecoderIO.notes`` says which). Graph rules for the single roles:

- token input: ``input_ids``, else the only remaining rank-2 integer input (two: ambiguous, an error);
- attention mask: ``attention_mask``; position ids: ``position_ids``, rank 2 ``[batch, seq]`` or rank 3
  ``[3, batch, seq]`` (mRoPE);
- logits: ``logits``, else the only float rank-3 output that is not a present (two: ambiguous);
- hidden states: optional outputs named ``hidden_states`` / ``last_hidden_state`` (``*hidden_states``).

KV and state pairs: :mod:`onnxgen.model.pairs`. Any graph input left without a role is an error.
``past_present_share_buffer`` is true when every past key/value is read only by com.microsoft
GroupQueryAttention nodes, unless genai_config's ``search.past_present_share_buffer`` is ``false``
(the exporter's word that present is not written in place wins; a ``true`` there over a graph that
cannot share is ignored with a note).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from onnxgen.errors import DecoderIOError
from onnxgen.model.declared import declared_plan
from onnxgen.model.genai import genai_plan
from onnxgen.model.graph_ports import GraphSignature
from onnxgen.model.io import DecoderIO, KVPair, StatePair, StaticCache
from onnxgen.model.kv import KVBuilder, reads_lengths_from_mask, shares_buffer, sliding_window
from onnxgen.model.naming import StateNames
from onnxgen.model.pairs import pair_by_name, special_kv_by_name, state_pair
from onnxgen.model.roles import (
    check_declared_shapes,
    check_index_input,
    check_named_ports,
    derive_roles,
    hidden_state_outputs,
)
from onnxgen.model.stated_io import Plan, graph_plan
from onnxgen.model.unsupported import check_supported

if TYPE_CHECKING:
    from onnxgen.model.package import ModelPackage


def choose_plan(package: ModelPackage) -> Plan:
    """The highest-precedence source that states any I/O for this package."""
    meta = package.inference_metadata
    if meta is not None:
        plan = declared_plan(meta, package.config_path("inference_metadata"))  # type: ignore[arg-type]
        if plan is not None:
            return plan
    genai = package.genai_config
    if genai is not None:
        plan = genai_plan(genai, package.config_path("genai_config"), package.signature)  # type: ignore[arg-type]
        if plan is not None:
            return plan
    return graph_plan()


def derive_io(package: ModelPackage, fed: Collection[str] = ()) -> DecoderIO:
    """Derive and check the decoder I/O of ``package`` (also available, cached, as ``package.io``).

    ``fed`` names graph inputs the caller feeds itself (an MTP head's hidden-state input): no role is
    derived for them and they are not refused as unknown; they stay in ``input_ports``."""
    sig = package.signature
    if fed:
        sig = GraphSignature(tuple(p for p in sig.inputs if p.name not in fed), sig.outputs)
    check_supported(sig)
    plan = choose_plan(package)
    check_named_ports(plan, sig)
    check_declared_shapes(plan, sig)
    notes = list(plan.notes)

    kv_pairs, state_pairs = _pairs(package, plan, notes)
    static = _static_cache(plan, sig, kv_pairs)
    cache_ports = {n for p in kv_pairs for n in (*p.inputs, *p.outputs)}
    cache_ports |= {n for s in state_pairs for n in (s.input, s.output)}
    static_inputs = {n for n in (static.write_indices, static.kv_lengths) if n} if static else set()
    roles = derive_roles(plan, sig, cache_ports | static_inputs, notes)
    hidden = hidden_state_outputs(sig, cache_ports | {roles.logits})
    _reject_unknown_inputs(sig, cache_ports | roles.inputs() | static_inputs)

    return DecoderIO(
        source=plan.source,
        token_input=roles.token_input,
        logits=roles.logits,
        attention_mask=roles.attention_mask,
        position_ids=roles.position_ids,
        position_ids_rank=roles.position_ids_rank,
        kv_pairs=kv_pairs,
        state_pairs=state_pairs,
        hidden_states=hidden,
        past_present_share_buffer=_share_buffer(package, list(kv_pairs), notes),
        static_cache=static,
        lengths_from_mask=reads_lengths_from_mask(package.graph, list(kv_pairs)),
        min_kv_capacity=sliding_window(package.graph),
        notes=tuple(notes),
        input_ports=package.signature.inputs,
        output_ports=sig.outputs,
    )


def _pairs(
    package: ModelPackage, plan: Plan, notes: list[str]
) -> tuple[tuple[KVPair, ...], tuple[StatePair, ...]]:
    """The plan's KV and state pairs, the graph rules filling whichever list the plan does not state."""
    sig = package.signature
    if plan.kv is None or plan.states is None:
        claimed = _claimed_by(plan)
        special, static = special_kv_by_name(sig, claimed) if plan.kv is None else ([], None)
        claimed |= {
            n for kv in special for n in (kv.past_key, kv.past_value, kv.present_key, kv.present_value)
        }
        graph_kv, graph_states = pair_by_name(sig, claimed)
        graph_kv = special + graph_kv
        if plan.kv is None:
            plan.kv = graph_kv
            plan.static = static
            _fallback_note(plan, notes, "KV pairs", len(graph_kv))
        if plan.states is None:
            plan.states = graph_states
            _fallback_note(plan, notes, "state pairs", len(graph_states))
    builder = KVBuilder(package.graph, sig, package.genai_config, package.hf_config)
    kv_pairs = tuple(builder.build(n) for n in plan.kv)
    notes.extend(builder.notes)
    return kv_pairs, tuple(_state(sig, n) for n in plan.states)


def _static_cache(plan: Plan, sig: GraphSignature, kv_pairs: tuple[KVPair, ...]) -> StaticCache | None:
    """The static cache's extra inputs and fixed length, where the KV pairs are static buffers."""
    static = [p for p in kv_pairs if p.layout == "static"]
    if not static:
        return None
    if len(static) != len(kv_pairs):
        others = ", ".join(p.past_key for p in kv_pairs if p.layout != "static")
        raise DecoderIOError(
            f"the graph mixes static cache buffers ({static[0].past_key}, ...) with growing KV caches ({others}); "
            "onnxgen runs one kind of KV cache per export"
        )
    names = plan.static
    if names is None:  # static pairs come with their names from every source
        raise DecoderIOError(f"{plan.origin} states static caches without a write-index input")
    for name, role in ((names.write_indices, "write indices"), (names.kv_lengths, "KV lengths")):
        if name is None:
            continue
        port = sig.input(name)
        if port is None:
            raise DecoderIOError(f"{plan.origin} names '{name}' ({role}), but the graph has no such input")
        check_index_input(port, role, ranks=(1,))
    lengths = {int(p.shape[p.seq_axis]) for p in static}  # type: ignore[arg-type]
    if len(lengths) != 1:
        raise DecoderIOError(
            f"static cache buffers hold different lengths {sorted(lengths)}; onnxgen needs one"
        )
    return StaticCache(names.write_indices, names.kv_lengths, lengths.pop())


def _claimed_by(plan: Plan) -> set[str]:
    claimed: set[str] = set()
    for kv in plan.kv or []:
        claimed |= {kv.past_key, kv.past_value, kv.present_key, kv.present_value}
    for st in plan.states or []:
        claimed |= {st.input, st.output}
    return claimed


def _fallback_note(plan: Plan, notes: list[str], what: str, found: int) -> None:
    if plan.source != "graph" and found:
        notes.append(f"{plan.origin} states no {what}; {found} derived from the graph")


def _state(sig: GraphSignature, names: StateNames) -> StatePair:
    past, present = sig.input(names.input), sig.output(names.output)
    if past is None or present is None:  # stated names are checked first; graph pairs exist by construction
        raise DecoderIOError(f"state pair '{names.input}' -> '{names.output}' is not in the graph")
    return state_pair(names, past, present)


def _reject_unknown_inputs(sig: GraphSignature, known: set[str]) -> None:
    unknown = [p for p in sig.inputs if p.name not in known]
    if not unknown:
        return
    shown = ", ".join(f"'{p.name}' ({p.dtype} {list(p.shape)})" for p in unknown)
    raise DecoderIOError(
        f"onnxgen does not know how to feed graph input(s) {shown}; if one is the token input, mask, "
        "position ids or a cache, declare its role in inference_metadata.yaml model.io (e.g. "
        f"'model: {{io: {{token_input: {unknown[0].name}}}}}'), else re-export the model without it"
    )


def _share_buffer(package: ModelPackage, kv_pairs: list[KVPair], notes: list[str]) -> bool:
    graph_says = shares_buffer(package.graph, kv_pairs)
    search = (package.genai_config or {}).get("search") or {}
    stated = search.get("past_present_share_buffer") if isinstance(search, dict) else None
    if stated is False and graph_says:
        notes.append(
            "genai_config.json search.past_present_share_buffer is false: past and present not shared"
        )
        return False
    if stated is True and not graph_says and kv_pairs:
        notes.append(
            "genai_config.json search.past_present_share_buffer is true, but not every past key/value feeds a "
            "GroupQueryAttention node: past and present not shared"
        )
    return graph_says


__all__ = ["choose_plan", "derive_io"]
