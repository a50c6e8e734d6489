"""The single-port roles (token input, mask, position ids, logits) and checks of stated port names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from onnxgen.errors import AmbiguousIOError, DecoderIOError
from onnxgen.model.graph_ports import GraphSignature
from onnxgen.model.io import Port, Shape
from onnxgen.model.naming import parse_present
from onnxgen.model.stated_io import Plan

_INT = {"int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64"}
# The element types onnxgen writes the inputs it feeds in (tokens, mask, positions, lengths, indices).
INDEX_DTYPES = ("int64", "int32")
_FLOAT = {"float32", "float16", "bfloat16", "float64"}
_HIDDEN = ("hidden_states", "last_hidden_state")
_INPUT_ROLES = ("token_input", "attention_mask", "position_ids")


@dataclass(frozen=True)
class Roles:
    token_input: str
    logits: str
    attention_mask: str | None
    position_ids: str | None
    position_ids_rank: int

    def inputs(self) -> set[str]:
        return {n for n in (self.token_input, self.attention_mask, self.position_ids) if n}


def _declare_hint(role: str, name: str) -> str:
    return f"declare it in inference_metadata.yaml: 'model: {{io: {{{role}: {name}}}}}'"


def check_named_ports(plan: Plan, sig: GraphSignature) -> None:
    """Every port a plan names exists in the graph (optional genai roles that do not are dropped)."""
    inputs = {p.name for p in sig.inputs}
    outputs = {p.name for p in sig.outputs}
    for role in (*_INPUT_ROLES, "logits"):
        name = getattr(plan, role) if plan.stated(role) else None
        if name is None or name in (outputs if role == "logits" else inputs):
            continue
        if role in plan.optional_roles:
            plan.notes.append(f"{plan.origin} names {role} '{name}', which the graph does not have; not fed")
            setattr(plan, role, None)
            continue
        _missing(plan, role, name, "output" if role == "logits" else "input", sig)
    for kv in plan.kv or []:
        for name, side in (
            (kv.past_key, "input"),
            (kv.past_value, "input"),
            (kv.present_key, "output"),
            (kv.present_value, "output"),
        ):
            if name not in (inputs if side == "input" else outputs):
                _missing(plan, f"layer {kv.layer} KV", name, side, sig)
    for st in plan.states or []:
        for name, side in ((st.input, "input"), (st.output, "output")):
            if name not in (inputs if side == "input" else outputs):
                _missing(plan, "state pair", name, side, sig)


def _missing(plan: Plan, role: str, name: str, side: str, sig: GraphSignature) -> None:
    ports = sig.inputs if side == "input" else sig.outputs
    listing = ", ".join(p.name for p in ports[:10]) + (", ..." if len(ports) > 10 else "")
    raise DecoderIOError(
        f"{plan.origin} names {side} '{name}' ({role}), but the graph has no such {side} (it has: {listing}); "
        f"fix the name in {plan.origin.split()[0]}"
    )


def _show(shape: Shape) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def check_declared_shapes(plan: Plan, sig: GraphSignature) -> None:
    """Declared shapes/dtypes equal the graph's: same rank, same concrete extents, symbolic where symbolic."""
    for name, shape in plan.shapes.items():
        port = sig.input(name) or sig.output(name)
        if port is None:
            _missing(plan, "declared shape", name, "input", sig)
            continue
        same = (
            port.rank_known
            and port.rank == len(shape)
            and all(
                (a == b) if isinstance(a, int) else not isinstance(b, int)
                for a, b in zip(shape, port.shape, strict=False)
            )
        )
        if not same:
            raise DecoderIOError(
                f"{plan.origin} declares '{name}' with shape {_show(shape)}, but the graph has "
                f"{_show(port.shape) if port.rank_known else 'no shape'}; fix the declaration to match the graph"
            )
    for name, dtype in plan.dtypes.items():
        port = sig.input(name) or sig.output(name)
        if port is not None and port.dtype != dtype:
            raise DecoderIOError(
                f"{plan.origin} declares '{name}' as {dtype}, but the graph has {port.dtype}"
            )


def _pick(plan: Plan, role: str, default: str, ports: tuple[Port, ...], used: set[str]) -> str | None:
    if plan.stated(role):
        return getattr(plan, role)
    return default if any(p.name == default and p.name not in used for p in ports) else None


def derive_roles(plan: Plan, sig: GraphSignature, cache_ports: set[str], notes: list[str]) -> Roles:
    used = set(cache_ports)
    mask = _pick(plan, "attention_mask", "attention_mask", sig.inputs, used)
    pos = _pick(plan, "position_ids", "position_ids", sig.inputs, used)
    used |= {n for n in (mask, pos) if n}
    token = _pick(plan, "token_input", "input_ids", sig.inputs, used) or _only_token_candidate(sig, used)
    if token is None:
        raise DecoderIOError(
            "the graph has no token input (no input_ids, and no rank-2 integer input left over); "
            f"{_declare_hint('token_input', 'NAME')}"
        )
    logits = _pick(plan, "logits", "logits", sig.outputs, cache_ports) or _only_logits_candidate(
        sig, cache_ports
    )
    if plan.source != "graph":
        found = {"token_input": token, "attention_mask": mask, "position_ids": pos, "logits": logits}
        missing = [f"{r} ({found[r]})" for r in (*_INPUT_ROLES, "logits") if not plan.stated(r) and found[r]]
        if missing:
            notes.append(f"{plan.origin} states no {', '.join(missing)}; derived from the graph")
    _check_port(
        sig.input(token), "token input", lambda p: p.dtype in _INT and p.rank == 2, "a rank-2 integer tensor"
    )
    check_index_input(sig.input(token), "token input")
    if mask:
        _check_port(sig.input(mask), "attention mask", lambda p: p.rank == 2, "rank 2 [batch, past+seq]")
        check_index_input(sig.input(mask), "attention mask")
    rank = 2
    if pos:
        port = sig.input(pos)
        _check_port(port, "position ids", _position_ok, "rank 2 [batch, seq] or rank 3 [3, batch, seq]")
        check_index_input(port, "position ids")
        rank = port.rank if port and port.rank_known else 2
    _check_port(
        sig.output(logits),
        "logits",
        lambda p: p.dtype in _FLOAT and p.rank == 3,
        "a float [batch, seq, vocab] tensor",
    )
    return Roles(token, logits, mask, pos, rank)


def check_index_input(port: Port | None, role: str, ranks: tuple[int, ...] | None = None) -> None:
    """An input onnxgen writes itself must be int64 or int32 (``ranks``: and of one of these ranks)."""
    if port is None:
        return
    if port.dtype not in INDEX_DTYPES:
        raise DecoderIOError(
            f"graph input '{port.name}' ({role}) is {port.dtype}; onnxgen feeds it as int64 or int32, the "
            "types exporters use: re-export the model with an int64 (or int32) "
            f"{role} input"
        )
    if ranks is not None and port.rank_known and port.rank not in ranks:
        raise DecoderIOError(
            f"graph input '{port.name}' ({role}) has rank {port.rank} {_show(port.shape)}; onnxgen feeds it as "
            f"a [batch] vector"
        )


def _position_ok(p: Port) -> bool:
    if p.dtype not in _INT:
        return False
    if p.rank == 2:
        return True
    return p.rank == 3 and (not isinstance(p.shape[0], int) or p.shape[0] == 3)


def _check_port(port: Port | None, role: str, ok: Callable[[Port], bool], wanted: str) -> None:
    if port is None or not port.rank_known:
        return
    if not ok(port):
        raise DecoderIOError(
            f"'{port.name}' ({role}) is {port.dtype} {_show(port.shape)}; onnxgen needs {wanted}"
        )


def _only_token_candidate(sig: GraphSignature, used: set[str]) -> str | None:
    cands = [p.name for p in sig.inputs if p.name not in used and p.dtype in _INT and p.rank == 2]
    if len(cands) > 1:
        raise AmbiguousIOError(
            f"graph inputs {', '.join(cands)} could each be the token input; {_declare_hint('token_input', cands[0])}"
        )
    return cands[0] if cands else None


def _only_logits_candidate(sig: GraphSignature, cache_ports: set[str]) -> str:
    cands = [
        p.name
        for p in sig.outputs
        if p.name not in cache_ports
        and p.dtype in _FLOAT
        and p.rank == 3
        and parse_present(p.name) is None
        and not p.name.endswith(_HIDDEN)
    ]
    if len(cands) > 1:
        raise AmbiguousIOError(
            f"graph outputs {', '.join(cands)} could each be the logits; {_declare_hint('logits_output', cands[0])}"
        )
    if not cands:
        raise DecoderIOError(
            "the graph has no logits output (named logits, or the only float rank-3 output that is not a present); "
            f"{_declare_hint('logits_output', 'NAME')}"
        )
    return cands[0]


def hidden_state_outputs(sig: GraphSignature, taken: set[str]) -> tuple[str, ...]:
    return tuple(p.name for p in sig.outputs if p.name not in taken and p.name.endswith(_HIDDEN))
