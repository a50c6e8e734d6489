"""Passes: fewer onnxruntime kernel launches per decode step, with bit-identical outputs.

A single-token step of a small int4 export is mostly fixed costs: every kernel that onnxruntime runs on
its thread pool hands work to the other threads and waits for them (a few µs at 2 threads), however
little work it has. Two patterns of onnxruntime-genai's builder launch more such kernels than the math
needs; both rewrites compute every output value exactly as before (tests compare them bit for bit).

1. **Sibling MatMulNBits** (:func:`merge_sibling_matmuls`): projections that read the same input with
   the same ``K``, ``bits``, ``block_size`` and ``accuracy_level`` (an MLP's ``gate_proj`` and
   ``up_proj``), both with zero points of one type or both without, become one ``MatMulNBits`` over the
   weights (scales, zero points) stacked along ``N`` followed by a ``Split``.
   Each output column is computed from its own weight row alone, so the columns do not change; the
   input is quantized once instead of once per projection. It pays only where the session runs two or
   more intra-op threads (:func:`merge_pays`): there the larger product divides between the threads
   better than its parts did; on one thread nothing divides and the ``Split`` only adds copies. Every
   kind of group the builder's exports hold (a linear attention's ``qkv_proj`` and ``z_proj``, an MLP's
   ``gate_proj`` and ``up_proj``) is merged by that one rule.
2. **Query and key RMSNorms** (:func:`merge_qk_norms`): a fused QKV projection's query and key heads
   each go ``Split -> Reshape [0, -1, head] -> SimplifiedLayerNormalization -> Reshape`` into
   GroupQueryAttention: two normalizations, each a thread-pool launch over a handful of rows. They
   become one ``SimplifiedLayerNormalization`` with weight 1 over the query and key heads together,
   then a ``Mul`` by the per-head weights. onnxruntime's CPU kernel multiplies by the weight last
   (``x / rms * weight``): with weight 1 it gives ``x / rms`` exactly, and the ``Mul`` rounds the same
   product (float32 only; tests check the bits, so an onnxruntime that computed it otherwise fails them).

3. **Query and key L2 norms of a linear attention** (:func:`merge_l2_norms`): a Gated DeltaNet layer
   splits its convolved ``q, k, v`` three ways and takes each of ``q`` and ``k`` through ``Reshape
   [0, 0, heads, dim] -> LpNormalization -> Reshape [0, 0, width]``. The query and key heads become one
   ``LpNormalization`` over both (a two-way split before it, another after): onnxruntime's CPU kernel
   normalizes each head's vector on its own, so the values do not change, and a step runs two nodes fewer
   per layer.

What the fusions save per step, and how it was measured (``scripts/runtime_ab.py MODEL --feature fuse``):
docs/benchmarks-history.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxgen.graph.passes import PassResult
from onnxgen.graph.state_window import attribute, constant_ints, default_opset, producers
from onnxgen.model.external_data import read_array
from onnxgen.model.graph_ports import consumers

MAX_INLINE_BYTES = 1 << 30  # merged weights kept inline go into the serialized graph (protobuf: 2 GiB)
# Makes the initializer ``name`` holding an array: inline by default (``numpy_helper.from_array``); a
# session graph's store writes it to a weights file and returns a reference (onnxgen.runtime.graph_cache).
Store = Callable[[str, np.ndarray], onnx.TensorProto]
_NBITS_ATTRS = ("K", "bits", "block_size", "accuracy_level")
MERGE_MIN_THREADS = 2  # sibling MatMulNBits are merged for sessions with at least this many intra-op threads


def merge_pays(threads: int) -> bool:
    """Whether rewrite 1 (sibling MatMulNBits merged) pays on a session with ``threads`` intra-op threads
    (measured per group on the real-size int4 exports: 0-4% off a decode step from 2 threads, nothing or a
    loss on 1; the numbers are in docs/benchmarks.md, "Real-size exports")."""
    return threads >= MERGE_MIN_THREADS


@dataclass
class Fusions:
    """What :func:`fuse_for_decode` changed, and why a pattern was left as it was."""

    merged_matmuls: int = 0  # MatMulNBits nodes now computed by a merged one
    merged_norms: int = 0  # query/key RMSNorm pairs now one normalization
    merged_l2_norms: int = 0  # linear attentions' query/key L2 norm pairs now one normalization
    separate_matmuls: int = 0  # MatMulNBits that would merge, left separate for a one-thread session
    skipped: list[str] = field(default_factory=list)

    @property
    def rewritten(self) -> bool:
        return bool(self.merged_matmuls or self.merged_norms or self.merged_l2_norms)

    def summary(self) -> str:
        """One line for reports (``onnxgen inspect``, ``onnxgen bench``)."""
        separate = (
            f"{self.separate_matmuls} MatMulNBits left separate on one thread"
            if self.separate_matmuls
            else ""
        )
        if not self.rewritten:
            return f"nothing merged: {separate}" if separate else "nothing to merge"
        return (
            f"{self.merged_matmuls} MatMulNBits merged in groups, {self.merged_norms} query/key norm pairs as one"
            + (f", {self.merged_l2_norms} query/key L2 norm pairs as one" if self.merged_l2_norms else "")
            + (f", {separate}" if separate else "")
        )


def _ints(node: onnx.NodeProto, name: str, default: int | None = None) -> int | None:
    attr = attribute(node, name)
    return int(attr.i) if attr is not None else default


def _is_contrib(node: onnx.NodeProto, op: str) -> bool:
    return node.op_type == op and node.domain == "com.microsoft"


def _is_onnx(node: onnx.NodeProto, op: str) -> bool:
    return node.op_type == op and node.domain in ("", "ai.onnx")


def _inline(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array, name)


def sibling_groups(model: onnx.ModelProto) -> list[list[onnx.NodeProto]]:
    """The MatMulNBits groups rewrite 1 merges (from the graph alone: no weight is read)."""
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    users = consumers(model)
    groups: dict[tuple, list[onnx.NodeProto]] = {}
    for node in graph.node:
        inputs = list(node.input)
        while inputs and not inputs[-1]:
            inputs.pop()
        if not _is_contrib(node, "MatMulNBits") or len(inputs) not in (3, 4) or len(node.output) != 1:
            continue  # g_idx or bias: left alone
        weight, scales = inits.get(inputs[1]), inits.get(inputs[2])
        zero_points = inits.get(inputs[3]) if len(inputs) == 4 else None
        if weight is None or scales is None or _ints(node, "N") is None or len(scales.dims) not in (1, 2):
            continue
        if len(inputs) == 4 and zero_points is None:
            continue
        if any(len(users.get(name, [])) != 1 for name in inputs[1:]):
            continue  # weights another node reads too
        key = (
            inputs[0],
            *(_ints(node, a, 4 if a == "bits" else 0) for a in _NBITS_ATTRS),
            tuple(weight.dims[1:]),
            weight.data_type,
            scales.data_type,
            tuple(scales.dims[1:]),
            *((zero_points.data_type, tuple(zero_points.dims[1:])) if zero_points is not None else ()),
        )
        groups.setdefault(key, []).append(node)
    return [group for group in groups.values() if len(group) > 1]


def merge_sibling_matmuls(
    model: onnx.ModelProto,
    base_dir: Path | None,
    fusions: Fusions,
    max_bytes: int | None = MAX_INLINE_BYTES,
    dry: bool = False,
    store: Store = _inline,
) -> None:
    """Rewrite 1 of the module docstring, in place (``dry``: count what it would merge, change nothing).
    ``base_dir`` resolves external weights, which are read one group at a time; ``store`` makes the merged
    initializers; ``max_bytes`` (None: no limit) caps the merged weights' bytes."""
    graph = model.graph
    if default_opset(model) < 13:
        fusions.skipped.append("sibling MatMulNBits: opset < 13 (Split takes its sizes as an input from 13)")
        return
    inits = {init.name: init for init in graph.initializer}
    budget = max_bytes if max_bytes is not None else float("inf")
    replace: dict[str, list[onnx.NodeProto]] = {}  # by the first output of the node they replace
    drop: set[str] = set()
    unused: set[str] = set()
    for group in sibling_groups(model):
        weights = [inits[n.input[1]] for n in group]
        scales = [inits[n.input[2]] for n in group]
        zero_points = [inits[n.input[3]] for n in group if len(n.input) > 3 and n.input[3]]
        size = sum(
            helper.tensor_dtype_to_np_dtype(t.data_type).itemsize * int(np.prod(t.dims))
            for t in weights + scales + zero_points
        )
        if size > budget:
            fusions.skipped.append(
                f"sibling MatMulNBits after {group[0].name!r}: weights over the inline limit"
            )
            continue
        budget -= size
        if dry:
            fusions.merged_matmuls += len(group)
            continue
        first = group[0]
        base = f"{first.name or first.output[0]}/onnxgen_merged"
        sizes = [_ints(n, "N", 0) for n in group]  # (sibling_groups keeps only nodes that state N)
        graph.initializer.extend(
            [
                store(f"{base}.weight", np.concatenate([read_array(t, base_dir) for t in weights])),
                store(f"{base}.scales", np.concatenate([read_array(t, base_dir) for t in scales])),
                numpy_helper.from_array(np.array(sizes, dtype=np.int64), f"{base}.sizes"),
            ]
        )
        if zero_points:  # per output row, like the weights: stacked along N the same way
            stacked = np.concatenate([read_array(t, base_dir) for t in zero_points])
            graph.initializer.append(store(f"{base}.zero_points", stacked))
        attrs: dict[str, Any] = {a: _ints(first, a) for a in _NBITS_ATTRS if attribute(first, a) is not None}
        attrs["N"] = sum(sizes)
        fused = helper.make_node(
            "MatMulNBits",
            [
                first.input[0],
                f"{base}.weight",
                f"{base}.scales",
                *([f"{base}.zero_points"] if zero_points else []),
            ],
            [f"{base}.out"],
            name=base,
            domain="com.microsoft",
            **attrs,
        )
        split = helper.make_node(
            "Split",
            [f"{base}.out", f"{base}.sizes"],
            [n.output[0] for n in group],
            name=f"{base}/split",
            axis=-1,
        )
        replace[first.output[0]] = [fused, split]
        drop.update(n.output[0] for n in group[1:])
        unused.update(t.name for t in weights + scales + zero_points)
        fusions.merged_matmuls += len(group)
    for i in reversed(range(len(graph.initializer))):
        if graph.initializer[i].name in unused:
            del graph.initializer[i]
    _splice(graph, replace, drop)


def _single_user(
    users: dict[str, list[onnx.NodeProto]], name: str, outputs: set[str]
) -> onnx.NodeProto | None:
    got = users.get(name, [])
    return got[0] if len(got) == 1 and name not in outputs else None


def _norm_path(
    graph: onnx.GraphProto, users: dict, outputs: set[str], prods: dict, start: str, width: int
) -> tuple[list[onnx.NodeProto], int] | None:
    """``start -> Reshape [0, -1, H] -> SimplifiedLayerNormalization -> Reshape [0, -1, width]``: the three
    nodes and H, or None."""
    r1 = _single_user(users, start, outputs)
    if r1 is None or not _is_onnx(r1, "Reshape") or r1.input[0] != start:
        return None
    shape = constant_ints(graph, r1.input[1], prods)
    if shape is None or len(shape) != 3 or shape[:2] != [0, -1] or shape[2] <= 0 or width % shape[2]:
        return None
    norm = _single_user(users, r1.output[0], outputs)
    if norm is None or norm.op_type != "SimplifiedLayerNormalization" or norm.input[0] != r1.output[0]:
        return None
    if _ints(norm, "axis", -1) != -1 or len([o for o in norm.output if o]) != 1 or len(norm.input) != 2:
        return None
    r2 = _single_user(users, norm.output[0], outputs)
    if (
        r2 is None
        or not _is_onnx(r2, "Reshape")
        or constant_ints(graph, r2.input[1], prods) != [0, -1, width]
    ):
        return None
    return [r1, norm, r2], shape[2]


def _three_way_splits(
    graph: onnx.GraphProto, prods: dict, axes: tuple[int, ...]
) -> list[tuple[onnx.NodeProto, list[int]]]:
    """The graph's ``Split`` nodes into three parts along one of ``axes`` with constant sizes (a
    ``[q | k | v]`` projection's candidates), each with its sizes; a list, so the caller may rewrite."""
    found = []
    for split in graph.node:
        if not _is_onnx(split, "Split") or len(split.output) != 3 or _ints(split, "axis", 0) not in axes:
            continue
        sizes = constant_ints(graph, split.input[1], prods) if len(split.input) > 1 else None
        if sizes is not None and len(sizes) == 3:
            found.append((split, sizes))
    return found


def merge_qk_norms(
    model: onnx.ModelProto,
    base_dir: Path | None,
    fusions: Fusions,
    dry: bool = False,
    store: Store = _inline,
) -> None:
    """Rewrite 2 of the module docstring, in place (``dry``: count what it would merge, change nothing);
    ``store`` makes the per-head weights' initializer."""
    graph = model.graph
    if default_opset(model) < 13:
        return
    inits = {init.name: init for init in graph.initializer}
    users = consumers(model)
    prods = producers(graph)
    outputs = {o.name for o in graph.output}
    replace: dict[str, list[onnx.NodeProto]] = {}  # by the first output of the node they replace
    drop: set[str] = set()
    for split, sizes in _three_way_splits(graph, prods, (-1, 2)):
        q = _norm_path(graph, users, outputs, prods, split.output[0], sizes[0])
        k = _norm_path(graph, users, outputs, prods, split.output[1], sizes[1])
        if q is None or k is None or q[1] != k[1]:
            continue
        (q_nodes, head), (k_nodes, _) = q, k
        # the value heads go straight into the GroupQueryAttention that takes the normed query and key:
        # its inputs are rank 3, so the split's input is [batch, tokens, width]
        attn = _single_user(users, split.output[2], outputs)
        if (
            attn is None
            or not _is_contrib(attn, "GroupQueryAttention")
            or list(attn.input[:3])
            != [
                q_nodes[2].output[0],
                k_nodes[2].output[0],
                split.output[2],
            ]
        ):
            continue
        q_norm, k_norm = q_nodes[1], k_nodes[1]
        if {(a.name, a.SerializeToString()) for a in q_norm.attribute} != {
            (a.name, a.SerializeToString()) for a in k_norm.attribute
        }:
            continue
        wq, wk = inits.get(q_norm.input[1]), inits.get(k_norm.input[1])
        if wq is None or wk is None or list(wq.dims) != [head] or list(wk.dims) != [head]:
            continue
        if wq.data_type != onnx.TensorProto.FLOAT or wk.data_type != onnx.TensorProto.FLOAT:
            continue  # float16: the kernel rounds x / rms to float16 before the weight, the Mul after it
        if dry:
            fusions.merged_norms += 1
            continue
        aq, ak = read_array(wq, base_dir), read_array(wk, base_dir)
        qh, kh = sizes[0] // head, sizes[1] // head
        base = f"{q_norm.name or split.output[0]}/onnxgen_qk"
        graph.initializer.extend(
            [
                numpy_helper.from_array(np.ones(head, aq.dtype), f"{base}.ones"),
                store(f"{base}.weight", np.concatenate([np.tile(aq, (qh, 1)), np.tile(ak, (kh, 1))])),
            ]
        )
        norm_attrs = {a.name: helper.get_attribute_value(a) for a in q_norm.attribute}
        middle = [
            helper.make_node(
                "SimplifiedLayerNormalization",
                [f"{base}.qk4", f"{base}.ones"],
                [f"{base}.normed"],
                name=f"{base}/norm",
                domain=q_norm.domain,
                **norm_attrs,
            ),
            helper.make_node(
                "Mul", [f"{base}.normed", f"{base}.weight"], [f"{base}.mid"], name=f"{base}/mul"
            ),
        ]
        outs = (q_nodes[2].output[0], k_nodes[2].output[0])
        replace[split.output[0]] = _merged_qk(graph, base, split, sizes, (qh + kh, head), outs, middle)
        drop.update(n.output[0] for n in q_nodes + k_nodes)
        fusions.merged_norms += 1
    _splice(graph, replace, drop)


def _l2_path(
    graph: onnx.GraphProto, users: dict, outputs: set[str], prods: dict, start: str, width: int
) -> tuple[list[onnx.NodeProto], list[int]] | None:
    """``start -> Reshape [0, 0, H, D] -> LpNormalization(p=2, last axis) -> Reshape [0, 0, width]``: the
    three nodes and [H, D], or None."""
    r1 = _single_user(users, start, outputs)
    if r1 is None or not _is_onnx(r1, "Reshape") or r1.input[0] != start or _ints(r1, "allowzero", 0):
        return None
    shape = constant_ints(graph, r1.input[1], prods)
    if shape is None or len(shape) != 4 or shape[:2] != [0, 0] or min(shape[2:]) <= 0:
        return None
    if shape[2] * shape[3] != width:
        return None
    norm = _single_user(users, r1.output[0], outputs)
    if norm is None or not _is_onnx(norm, "LpNormalization") or norm.input[0] != r1.output[0]:
        return None
    if _ints(norm, "axis", -1) not in (-1, 3) or _ints(norm, "p", 2) != 2:
        return None
    r2 = _single_user(users, norm.output[0], outputs)
    if r2 is None or not _is_onnx(r2, "Reshape") or _ints(r2, "allowzero", 0):
        return None
    if constant_ints(graph, r2.input[1], prods) != [0, 0, width]:
        return None
    return [r1, norm, r2], shape[2:]


def merge_l2_norms(model: onnx.ModelProto, fusions: Fusions, dry: bool = False) -> None:
    """Rewrite 3 of the module docstring, in place (``dry``: count what it would merge, change nothing)."""
    graph = model.graph
    if default_opset(model) < 13:
        return
    users = consumers(model)
    prods = producers(graph)
    outputs = {o.name for o in graph.output}
    replace: dict[str, list[onnx.NodeProto]] = {}
    drop: set[str] = set()
    for split, sizes in _three_way_splits(graph, prods, (-1,)):
        q = _l2_path(graph, users, outputs, prods, split.output[0], sizes[0])
        k = _l2_path(graph, users, outputs, prods, split.output[1], sizes[1])
        if q is None or k is None or q[1][1] != k[1][1]:
            continue
        (q_nodes, (qh, dim)), (k_nodes, (kh, _)) = q, k
        if dry:
            fusions.merged_l2_norms += 1
            continue
        base = f"{q_nodes[1].name or split.output[0]}/onnxgen_qk_l2"
        norm_attrs = {a.name: helper.get_attribute_value(a) for a in q_nodes[1].attribute}
        middle = [
            helper.make_node(
                "LpNormalization", [f"{base}.qk4"], [f"{base}.mid"], name=f"{base}/norm", **norm_attrs
            )
        ]
        outs = (q_nodes[2].output[0], k_nodes[2].output[0])
        replace[split.output[0]] = _merged_qk(graph, base, split, sizes, (qh + kh, dim), outs, middle)
        drop.update(n.output[0] for n in q_nodes + k_nodes)
        fusions.merged_l2_norms += 1
    _splice(graph, replace, drop)


def _merged_qk(
    graph: onnx.GraphProto,
    base: str,
    split: onnx.NodeProto,
    sizes: list[int],
    heads: tuple[int, int],
    outs: tuple[str, str],
    middle: list[onnx.NodeProto],
) -> list[onnx.NodeProto]:
    """The nodes that replace a ``[q | k | v]`` split's separate query and key paths: split off ``q | k``
    together, view it as ``heads = (query + key heads, head dim)``, run ``middle`` (from ``{base}.qk4`` to
    ``{base}.mid``) over all those heads at once, and split the result back into ``outs``."""
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([sizes[0] + sizes[1], sizes[2]], np.int64), f"{base}.outer"),
            numpy_helper.from_array(np.array([0, 0, *heads], np.int64), f"{base}.heads"),
            numpy_helper.from_array(np.array([0, 0, sizes[0] + sizes[1]], np.int64), f"{base}.flat"),
            numpy_helper.from_array(np.array(sizes[:2], np.int64), f"{base}.inner"),
        ]
    )
    return [
        helper.make_node(
            "Split", [split.input[0], f"{base}.outer"], [f"{base}.qk", split.output[2]], name=base, axis=-1
        ),
        helper.make_node("Reshape", [f"{base}.qk", f"{base}.heads"], [f"{base}.qk4"], name=f"{base}/reshape"),
        *middle,
        helper.make_node(
            "Reshape", [f"{base}.mid", f"{base}.flat"], [f"{base}.qk3"], name=f"{base}/reshape_back"
        ),
        helper.make_node(
            "Split", [f"{base}.qk3", f"{base}.inner"], list(outs), name=f"{base}/split", axis=-1
        ),
    ]


def _splice(graph: onnx.GraphProto, replace: dict[str, list[onnx.NodeProto]], drop: set[str]) -> None:
    """Put each replacement where its node was (its inputs exist there) and drop the merged nodes (nodes
    are named by their first output)."""
    if not replace:
        return
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        key = node.output[0] if node.output else ""
        if key in replace:
            nodes.extend(replace[key])
        elif key not in drop:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def fuse_for_decode(
    model: onnx.ModelProto, base_dir: Path | None, store: Store | None = None, merge_matmuls: bool = True
) -> PassResult[Fusions]:
    """The rewrites on a copy of ``model`` (returned as is when none applies); rewrite 1 only with
    ``merge_matmuls`` (:func:`merge_pays` for the session's threads). With ``store`` the merged weights go
    where it puts them (no size limit); without it they are inline in the graph."""
    planned = planned_fusions(model, merge_matmuls)
    if not planned.rewritten:
        return PassResult(model, False, planned)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    fusions = Fusions()
    merge_qk_norms(out, base_dir, fusions, store=store or _inline)
    merge_l2_norms(out, fusions)
    if merge_matmuls:
        limit = MAX_INLINE_BYTES if store is None else None
        merge_sibling_matmuls(out, base_dir, fusions, max_bytes=limit, store=store or _inline)
    fusions.separate_matmuls = planned.separate_matmuls
    return PassResult(out, True, fusions)


def planned_fusions(model: onnx.ModelProto, merge_matmuls: bool = True) -> Fusions:
    """What :func:`fuse_for_decode` would merge, from the graph alone."""
    fusions = Fusions()
    merge_qk_norms(model, None, fusions, dry=True)
    merge_l2_norms(model, fusions, dry=True)
    if merge_matmuls:
        merge_sibling_matmuls(model, None, fusions, dry=True)
    else:
        fusions.separate_matmuls = sum(len(group) for group in sibling_groups(model))
    return fusions
