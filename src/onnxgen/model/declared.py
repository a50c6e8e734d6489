"""The ``model.io`` block of inference_metadata (yaml/yml/json): the declared I/O, highest precedence.

Keys (all optional; a key that is absent leaves its role to the graph rules)::

    model:
      io:
        token_input: input_ids
        attention_mask_input: attention_mask
        position_ids_input: position_ids          # null: the graph has none
        logits_output: logits
        kv_inputs:  [past_key_values.3.key, past_key_values.3.value, ...]   # paired by position
        kv_outputs: [present.3.key, present.3.value, ...]
        state_pairs:
          - {input: past_key_values.0.conv_state, output: present.0.conv_state, init: zeros, update: replace}
        static_cache:                             # fixed-length KV buffers (mobius --static-cache)
          write_indices_input: write_indices
          kv_sequence_length_input: nonpad_kv_seqlen
          key_cache_inputs: [key_cache.0, ...]    # paired by position with value_cache_inputs and outputs
          value_cache_inputs: [value_cache.0, ...]
          key_cache_outputs: [updated_key_cache.0, ...]
          value_cache_outputs: [updated_value_cache.0, ...]

A port entry may be a name or ``{name: ..., shape: [...], dtype: ...}``; a state pair may carry
``shape``/``dtype`` for its input. Declared shapes must match the graph exactly (symbolic axis names are
not compared, but a symbolic axis must be symbolic in the graph too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from onnxgen.errors import ConfigError, DecoderIOError
from onnxgen.model.naming import KVNames, StateNames, kv_role, layer_of, parse_past, state_kind
from onnxgen.model.stated_io import Plan, StaticNames

_ROLE_KEYS = {
    "token_input": "token_input",
    "attention_mask_input": "attention_mask",
    "position_ids_input": "position_ids",
    "logits_output": "logits",
}


def declared_plan(metadata: dict[str, Any], path: Path) -> Plan | None:
    """The plan stated by ``metadata`` (parsed inference_metadata), or ``None`` without a ``model.io``."""
    model = metadata.get("model")
    io = model.get("io") if isinstance(model, dict) else None
    if io is None:
        return None
    origin = f"{path.name} model.io"
    if not isinstance(io, dict):
        raise ConfigError(f"{path}: model.io must be a mapping of roles to port names")
    plan = Plan(source="declared", origin=origin)
    for key, role in _ROLE_KEYS.items():
        if key in io:
            setattr(plan, role, _port_name(plan, io[key], f"{origin}.{key}", path))
    if "kv_inputs" in io or "kv_outputs" in io:
        plan.kv = _kv(plan, io.get("kv_inputs"), io.get("kv_outputs"), origin, path)
    if "state_pairs" in io:
        plan.states = _states(plan, io["state_pairs"], origin, path)
    if io.get("static_cache") is not None:
        static = _static_cache(plan, io["static_cache"], f"{origin}.static_cache", path)
        plan.kv = [*(plan.kv or []), *static]
    return plan


_STATIC_LISTS = ("key_cache_inputs", "value_cache_inputs", "key_cache_outputs", "value_cache_outputs")


def _static_cache(plan: Plan, block: Any, where: str, path: Path) -> list[KVNames]:
    """The static KV caches a ``static_cache`` block declares (lists paired by position)."""
    if not isinstance(block, dict):
        raise ConfigError(f"{path}: {where} must be a mapping (write_indices_input, key_cache_inputs, ...)")
    write = block.get("write_indices_input")
    lengths = block.get("kv_sequence_length_input")
    if not isinstance(write, str) or not (lengths is None or isinstance(lengths, str)):
        raise ConfigError(
            f"{path}: {where}.write_indices_input must name the write-index input "
            "(and kv_sequence_length_input, when given, the live-length input)"
        )
    lists = [_names(plan, block.get(key) or [], f"{where}.{key}", path) for key in _STATIC_LISTS]
    if len({len(names) for names in lists}) != 1 or not lists[0]:
        sizes = ", ".join(f"{key} {len(names)}" for key, names in zip(_STATIC_LISTS, lists, strict=True))
        raise DecoderIOError(
            f"{where}: the four cache lists pair by position and must be equally long ({sizes})"
        )
    plan.static = StaticNames(write, lengths)
    out = []
    for i, (k_in, v_in, k_out, v_out) in enumerate(zip(*lists, strict=True)):
        layer = next((int(part) for part in reversed(k_in.replace("_", ".").split(".")) if part.isdigit()), i)
        out.append(KVNames(layer, k_in, v_in, k_out, v_out, layout="static"))
    return out


def _port_name(plan: Plan, entry: Any, where: str, path: Path) -> str | None:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("name"), str):
        name: str = entry["name"]
        _record_shape(plan, name, entry, where, path)
        return name
    raise ConfigError(f"{path}: {where} must be a port name or {{name, shape, dtype}}, not {entry!r}")


def _record_shape(plan: Plan, name: str, entry: dict[str, Any], where: str, path: Path) -> None:
    shape = entry.get("shape")
    if shape is not None:
        if not isinstance(shape, list) or not all(isinstance(d, (int, str)) or d is None for d in shape):
            raise ConfigError(f"{path}: {where} shape must be a list of ints/axis names, not {shape!r}")
        plan.shapes[name] = tuple(shape)
    if isinstance(entry.get("dtype"), str):
        plan.dtypes[name] = entry["dtype"]


def _names(plan: Plan, value: Any, where: str, path: Path) -> list[str]:
    if not isinstance(value, list):
        raise ConfigError(f"{path}: {where} must be a list of port names")
    names = [_port_name(plan, v, f"{where}[{i}]", path) for i, v in enumerate(value)]
    if any(n is None for n in names):
        raise ConfigError(f"{path}: {where} holds an empty entry")
    return [n for n in names if n is not None]


def _kv(plan: Plan, inputs: Any, outputs: Any, origin: str, path: Path) -> list[KVNames]:
    ins = _names(plan, inputs or [], f"{origin}.kv_inputs", path)
    outs = _names(plan, outputs or [], f"{origin}.kv_outputs", path)
    if len(ins) != len(outs):
        raise DecoderIOError(
            f"{origin}: kv_inputs has {len(ins)} names but kv_outputs has {len(outs)}; they pair by position"
        )
    keys: dict[int, tuple[str, str]] = {}
    values: dict[int, tuple[str, str]] = {}
    for i, (past, present) in enumerate(zip(ins, outs, strict=False)):
        parsed = parse_past(past)
        role = kv_role(parsed[1]) if parsed else None
        layer = parsed[0] if parsed else i // 2
        role = role or ("key" if i % 2 == 0 else "value")  # unparsable names: [key_i, value_i] interleaved
        table = keys if role == "key" else values
        if layer in table:
            raise DecoderIOError(f"{origin}: two {role} inputs for layer {layer} ({table[layer][0]}, {past})")
        table[layer] = (past, present)
    if set(keys) != set(values):
        odd = sorted(set(keys) ^ set(values))
        raise DecoderIOError(f"{origin}: layers {odd} have a key without a value (or a value without a key)")
    return [
        KVNames(layer, keys[layer][0], values[layer][0], keys[layer][1], values[layer][1])
        for layer in sorted(keys)
    ]


def _states(plan: Plan, value: Any, origin: str, path: Path) -> list[StateNames]:
    if not isinstance(value, list):
        raise ConfigError(f"{path}: {origin}.state_pairs must be a list of {{input, output}} mappings")
    out: list[StateNames] = []
    for i, entry in enumerate(value):
        where = f"{origin}.state_pairs[{i}]"
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("input"), str)
            or not isinstance(entry.get("output"), str)
        ):
            raise ConfigError(f"{path}: {where} must be a mapping with 'input' and 'output' port names")
        init, update = entry.get("init", "zeros"), entry.get("update", "replace")
        if init != "zeros" or update != "replace":
            raise DecoderIOError(
                f"{where}: init={init!r}, update={update!r} is not supported (onnxgen starts states at zeros "
                "and replaces them with the output each step)"
            )
        _record_shape(plan, entry["input"], entry, where, path)
        name = entry["input"]
        out.append(StateNames(name, entry["output"], layer_of(name), state_kind(name)))
    return out
