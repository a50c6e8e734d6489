"""``genai_config.json`` ``model.decoder`` name templates: the second source of decoder I/O.

``inputs``: ``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_names`` /
``past_value_names`` (e.g. ``past_key_values.%d.key``), or ``past_names`` (``past_%d``: GPT-2 style
stacked key and value, with ``outputs.present_names``), ``past_conv_names`` (``past.%d.conv``),
``past_recurrent_names``; ``outputs``: ``logits``, ``present_key_names``, ``present_value_names``,
``present_conv_names``, ``present_recurrent_names``. Templates expand over the layer indices the graph
actually has (a hybrid's KV exists only at its attention layers). onnxruntime-genai treats
``attention_mask``/``position_ids`` as optional (it checks whether the graph has them), so a named
mask or position input the graph lacks is dropped with a note rather than an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from onnxgen.errors import DecoderIOError
from onnxgen.model.graph_ports import GraphSignature
from onnxgen.model.naming import KVNames, StateNames, expand, template_layers
from onnxgen.model.stated_io import Plan

_STATE_TEMPLATES = (
    ("past_conv_names", "present_conv_names", "conv"),
    ("past_recurrent_names", "present_recurrent_names", "recurrent"),
)


def _str(section: dict[str, Any], key: str) -> str | None:
    v = section.get(key)
    return v if isinstance(v, str) and v else None


def genai_plan(genai: dict[str, Any], path: Path, sig: GraphSignature) -> Plan | None:
    """The plan ``genai`` states for ``sig``, or ``None`` when it has no ``model.decoder`` section."""
    decoder = (genai.get("model") or {}).get("decoder")
    if not isinstance(decoder, dict):
        return None
    ins, outs = decoder.get("inputs"), decoder.get("outputs")
    ins = ins if isinstance(ins, dict) else {}
    outs = outs if isinstance(outs, dict) else {}
    plan = Plan(source="genai_config", origin=f"{path.name} model.decoder")
    plan.optional_roles = frozenset({"attention_mask", "position_ids"})
    for key, role in (
        ("input_ids", "token_input"),
        ("attention_mask", "attention_mask"),
        ("position_ids", "position_ids"),
    ):
        if name := _str(ins, key):
            setattr(plan, role, name)
    if name := _str(outs, "logits"):
        plan.logits = name
    input_names = [p.name for p in sig.inputs]
    plan.kv = _kv(plan, ins, outs, input_names)
    states = _states(plan, ins, outs, input_names)
    if states is not None:
        plan.states = states
    return plan


def _template(plan: Plan, section: dict[str, Any], key: str, side: str) -> str | None:
    tpl = _str(section, key)
    if tpl is not None and tpl.count("%d") != 1:
        raise DecoderIOError(
            f"{plan.origin}.{side}.{key} = {tpl!r} must contain exactly one %d; fix the template"
        )
    return tpl


def _kv(
    plan: Plan, ins: dict[str, Any], outs: dict[str, Any], input_names: list[str]
) -> list[KVNames] | None:
    stacked = _template(plan, ins, "past_names", "inputs")
    if stacked is not None:
        present = _template(plan, outs, "present_names", "outputs")
        if present is None:
            raise DecoderIOError(f"{plan.origin}.inputs.past_names is given without outputs.present_names")
        layers = template_layers(stacked, input_names)
        if layers:
            return [
                KVNames(
                    i,
                    expand(stacked, i),
                    expand(stacked, i),
                    expand(present, i),
                    expand(present, i),
                    "stacked",
                )
                for i in layers
            ]
        plan.notes.append(f"{plan.origin}.inputs.past_names {stacked!r} matches no graph input")
    pk = _template(plan, ins, "past_key_names", "inputs")
    pv = _template(plan, ins, "past_value_names", "inputs")
    prk = _template(plan, outs, "present_key_names", "outputs")
    prv = _template(plan, outs, "present_value_names", "outputs")
    if not (pk and pv and prk and prv):
        if pk or pv or prk or prv:
            plan.notes.append(f"{plan.origin}: incomplete KV templates; KV pairs derived from the graph")
        return None
    layers = template_layers(pk, input_names)
    if not layers:
        plan.notes.append(
            f"{plan.origin}.inputs.past_key_names {pk!r} matches no graph input; KV derived from the graph"
        )
        return None
    return [KVNames(i, expand(pk, i), expand(pv, i), expand(prk, i), expand(prv, i)) for i in layers]


def _states(
    plan: Plan, ins: dict[str, Any], outs: dict[str, Any], input_names: list[str]
) -> list[StateNames] | None:
    found: list[StateNames] = []
    stated = False
    for past_key, present_key, kind in _STATE_TEMPLATES:
        past = _template(plan, ins, past_key, "inputs")
        present = _template(plan, outs, present_key, "outputs")
        if past is None and present is None:
            continue
        if past is None or present is None:
            raise DecoderIOError(
                f"{plan.origin}: {past_key if past else present_key} is given without "
                f"{present_key if past else past_key}; give both templates or neither"
            )
        layers = template_layers(past, input_names)
        if not layers:
            plan.notes.append(f"{plan.origin}.inputs.{past_key} {past!r} matches no graph input")
            continue
        stated = True
        for i in layers:
            found.append(StateNames(expand(past, i), expand(present, i), i, kind))
    if not stated:
        return None  # genai_config states no recurrent state: the graph rules look for some
    return sorted(found, key=lambda s: (s.layer or 0, s.kind))
