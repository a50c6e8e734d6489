"""A model's summary for ``onnxgen inspect``: export family, I/O roles and pairs, notable ops, settings."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

from onnxgen.model.graph_ports import MS_DOMAIN, all_nodes, has_op, local_functions, op_counts
from onnxgen.model.io import DecoderIO, KVPair, Shape, StatePair
from onnxgen.model.package import ModelPackage


def _scan_inside_functions(package: ModelPackage) -> bool:
    return any(n.op_type == "Scan" and not n.domain for f in package.graph.functions for n in f.node)


def export_family(package: ModelPackage, io: DecoderIO) -> str:
    """A short name for how the model was exported, from its ops (and whether it carries state)."""
    g = package.graph
    if io.state_pairs:
        if has_op(g, "LinearAttention", MS_DOMAIN):
            return "hybrid (com.microsoft LinearAttention)"
        if has_op(g, "Scan"):
            return (
                "hybrid (ONNX Scan in model-local functions)"
                if _scan_inside_functions(package)
                else "hybrid (ONNX Scan)"
            )
        if g.functions:
            return "hybrid (model-local functions)"
        return "hybrid"
    if has_op(g, "GroupQueryAttention", MS_DOMAIN):
        return "onnxruntime-genai (GroupQueryAttention)"
    if has_op(g, "Attention"):
        return "standard ONNX (Attention op)"
    if has_op(g, "MultiHeadAttention", MS_DOMAIN) or has_op(g, "Attention", MS_DOMAIN):
        return "onnxruntime contrib attention"
    return "standard ONNX"


def _shape(shape: Shape) -> list[int | str | None]:
    return list(shape)


def _kv_json(io: DecoderIO, p: KVPair) -> dict[str, Any]:
    return {
        "layer": p.layer,
        "past_key": p.past_key,
        "past_value": p.past_value,
        "present_key": p.present_key,
        "present_value": p.present_value,
        "shape": _shape(io.port(p.past_key).shape),
        "dtype": p.dtype,
        "kv_heads": p.kv_heads,
        "head_dim": p.head_dim,
        "layout": p.layout,
    }


def _kv_cache_json(io: DecoderIO) -> dict[str, Any]:
    """How the runtime keeps the KV caches: the mode, the layout and a static cache's inputs."""
    out: dict[str, Any] = {"mode": io.kv_mode, "layout": io.kv_pairs[0].layout if io.kv_pairs else None}
    if io.static_cache is not None:
        out |= {
            "write_indices": io.static_cache.write_indices,
            "kv_lengths": io.static_cache.kv_lengths,
            "length": io.static_cache.length,
        }
    return out


def _state_json(s: StatePair) -> dict[str, Any]:
    return {
        "layer": s.layer,
        "kind": s.kind,
        "input": s.input,
        "output": s.output,
        "shape": _shape(s.shape),
        "dtype": s.dtype,
    }


def describe(package: ModelPackage) -> dict[str, Any]:
    """Everything ``onnxgen inspect`` shows, as one JSON-serialisable mapping."""
    io = package.io
    settings = package.settings
    calls = local_functions(package.graph)
    return {
        "model": str(package.model_path),
        "family": export_family(package, io),
        "source": io.source,
        "token_input": io.token_input,
        "attention_mask": io.attention_mask,
        "position_ids": io.position_ids,
        "position_ids_rank": io.position_ids_rank if io.position_ids else None,
        "logits": io.logits,
        "hidden_states": list(io.hidden_states),
        "kv_pairs": [_kv_json(io, p) for p in io.kv_pairs],
        "state_pairs": [_state_json(s) for s in io.state_pairs],
        "past_present_share_buffer": io.past_present_share_buffer,
        "kv_cache": _kv_cache_json(io),
        "ops": op_counts(package.graph),
        "functions": sorted(f"{d}::{n}" for d, n in calls),
        "node_count": sum(1 for _ in all_nodes(package.graph)),
        "context_length": package.context_length,
        "eos_token_id": list(settings.eos_token_ids),
        "bos_token_id": settings.bos_token_id,
        "pad_token_id": settings.pad_token_id,
        "settings_sources": dict(settings.sources),
        "files": sorted(str(p.name) for p, _ in package.configs.values()),
        "notes": [*package.notes, *io.notes],
    }


def layer_list(layers: list[int]) -> str:
    """``[3, 7, 11, 15]`` -> ``"3..15 step 4"``; ``[0, 1, 2]`` -> ``"0..2"``; long irregular lists are cut."""
    if len(layers) >= 3:
        step = layers[1] - layers[0]
        if step > 0 and all(b - a == step for a, b in itertools.pairwise(layers)):
            return f"{layers[0]}..{layers[-1]}" + (f" step {step}" if step > 1 else "")
    if len(layers) > 10:
        head = ", ".join(map(str, layers[:6]))
        return f"{head}, ..., {layers[-1]} ({len(layers)} layers)"
    return ", ".join(map(str, layers))


def _fmt_shape(shape: list[Any]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _grouped(items: list[dict[str, Any]], key: tuple[str, ...]) -> list[tuple[tuple[Any, ...], list[int]]]:
    groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for item in items:
        groups[tuple(_fmt_shape(item[k]) if k == "shape" else item[k] for k in key)].append(item["layer"])
    return list(groups.items())


def _pair_lines(d: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    kv = d["kv_pairs"]
    tensors = sum(1 if p["layout"] == "stacked" else 2 for p in kv)
    lines.append(f"KV pairs:       {len(kv)} layer{'' if len(kv) == 1 else 's'} ({tensors} past tensors)")
    for (shape, dtype), layers in _grouped(kv, ("shape", "dtype")):
        example = next(p for p in kv if p["layer"] == layers[0])
        lines.append(
            f"  layer{'s' if len(layers) > 1 else ''} {layer_list(sorted(layers))}: {example['past_key']} -> {example['present_key']} "
            f"{shape} {dtype} (kv_heads {example['kv_heads']}, head_dim {example['head_dim']})"
        )
    st = d["state_pairs"]
    lines.append(f"state pairs:    {len(st)}")
    for (kind, shape, dtype), layers in _grouped(st, ("kind", "shape", "dtype")):
        example = next(s for s in st if s["layer"] == layers[0] and s["kind"] == kind)
        where = layer_list(sorted(x for x in layers if x is not None)) or "-"
        lines.append(f"  {kind} at layers {where}: {example['input']} -> {example['output']} {shape} {dtype}")
    return lines


def format_text(d: dict[str, Any]) -> str:
    """The human-readable form of :func:`describe`'s mapping."""
    lines = [
        f"model:          {d['model']}",
        f"family:         {d['family']}",
        f"I/O from:       {d['source']}",
        f"token input:    {d['token_input']}",
        f"attention mask: {d['attention_mask'] or '-'}",
        f"position ids:   {d['position_ids'] or '-'}"
        + (f" (rank {d['position_ids_rank']})" if d["position_ids"] else ""),
        f"logits:         {d['logits']}",
    ]
    if d["hidden_states"]:
        lines.append(f"hidden states:  {', '.join(d['hidden_states'])}")
    lines.extend(_pair_lines(d))
    lines.append(f"KV cache:       {_kv_cache_text(d['kv_cache'])}")
    if d.get("decode_plan"):  # added by `onnxgen inspect` (onnxgen.runtime.decode_routing.settle_decode_plan)
        lines.append(f"decode plan:    {d['decode_plan']} ({d.get('decode_plan_reason', '')})")
    if d.get("fast_ops"):  # added by `onnxgen inspect` (onnxgen.graph.hybrid_ops)
        lines.append(f"fast ops:       {d['fast_ops']}")
    if d.get("decode_fusions"):  # added by `onnxgen inspect` (onnxgen.graph.decode_fusions)
        lines.append(f"fusions (CPU):  {d['decode_fusions']}")
    if d.get("mtp_head"):  # added by `onnxgen inspect` (onnxgen.model.mtp)
        lines.append(f"MTP head:       {d['mtp_head']}")
    if d.get("prefix_cache_kv_per_token"):  # added by `onnxgen inspect` (onnxgen.cache.prefix)
        lines.append(f"prefix cache:   KV {d['prefix_cache_kv_per_token']} per cached token")
    if d.get("prefix_cache_state_checkpoint"):
        lines.append(f"                {d['prefix_cache_state_checkpoint']} per recurrent-state checkpoint")
    lines.append(f"context length: {d['context_length'] if d['context_length'] is not None else 'unknown'}")
    lines.append(
        f"eos / bos / pad: {d['eos_token_id'] or '-'} / {_opt(d['bos_token_id'])} / {_opt(d['pad_token_id'])}"
    )
    eos_from = d["settings_sources"].get("eos_token_id")
    lines.append(
        f"eos from:       {eos_from}"
        if eos_from
        else "eos from:       nowhere: no config or tokenizer token says where a sequence ends; generation "
        "stops at max_new_tokens (SamplingParams(stop_token_ids=...) adds stop tokens)"
    )
    lines.append(f"ops ({d['node_count']} nodes, incl. functions and subgraphs):")
    for domain, ops in d["ops"].items():
        lines.append(f"  {domain}: " + ", ".join(f"{op}×{n}" for op, n in ops.items()))
    if d["functions"]:
        lines.append(f"local functions: {', '.join(d['functions'])}")
    if d["files"]:
        lines.append(f"config files:   {', '.join(d['files'])}")
    lines.extend(f"note: {n}" for n in d["notes"])
    return "\n".join(lines)


def _kv_cache_text(kv: dict[str, Any]) -> str:
    mode, layout = kv["mode"], kv["layout"]
    if layout is None:
        return "none"
    if mode == "static":
        lengths = f", live lengths {kv['kv_lengths']}" if kv["kv_lengths"] else ""
        return f"static, {kv['length']} positions written in place at {kv['write_indices']}{lengths}"
    shape = "[2, batch, heads, seq, dim] stacked" if layout == "stacked" else "[batch, heads, seq, dim]"
    how = "shared past/present buffer, written in place" if mode == "shared" else "grows each step"
    return f"{shape}, {how}"


def _opt(v: object) -> str:
    return "-" if v is None else str(v)
