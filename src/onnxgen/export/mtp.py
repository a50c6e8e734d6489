"""``onnxgen export-mtp``: write a checkpoint's MTP head as ``mtp.onnx`` beside the decoder export.

The head reuses the decoder's embedding lookup and lm_head as they are in the export (the same ops, e.g.
an int4 ``MatMulNBits`` lm_head, over the same initializers). Initializers the decoder keeps in an external
data file in the export directory are shared by reference (``mtp.onnx`` points into ``model.onnx.data``:
nothing is copied on disk); others are copied into ``mtp.onnx.data`` with the head's own weights. The
decoder's rotary cos/sin tables are shared the same way where they hold the head's rotary embedding
(same width, same angles), else the head gets its own over the export's context length (rotary
nodes on the position ids where it states none).

Precision follows the decoder unless given: int4 (``MatMulNBits``, symmetric, block size 32, the decoder's
``accuracy_level``, quantized by onnxruntime's own block quantizer) when the decoder has int4 projections,
else fp32.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir

from onnxgen.errors import ModelPackageError, UnsupportedModelError
from onnxgen.export import PRECISIONS as PRECISIONS
from onnxgen.export.mtp_graph import (
    MS,
    Borrowed,
    Quantize,
    RotaryCaches,
    Transposed,
    build_mtp_graph,
    fused_rotary_fits,
    rotary_tables,
)
from onnxgen.export.mtp_weights import MTPGeometry, check_weights, read_mtp_checkpoint
from onnxgen.graph.logits_to_keep import find_lm_head
from onnxgen.model.mtp import MTP_FILE, find_mtp_head, mtp_head_io
from onnxgen.model.package import ModelPackage
from onnxgen.runtime.int4 import quantize_int4
from onnxgen.runtime.mtp_head import MTPHeadSession

MTP_DATA = "mtp.onnx.data"
EXTERNAL_MIN_BYTES = 1024
DEFAULT_ACCURACY_LEVEL = 4  # onnxruntime-genai's builder's default for int4 on the CPU
_EMBEDDING_OPS = {("", "Gather"), (MS, "GatherBlockQuantized")}


@dataclass
class MTPExport:
    """What :func:`write_mtp_head` wrote."""

    path: Path
    precision: str
    accuracy_level: int | None
    shared: list[str] = field(default_factory=list)  # decoder initializers the head reads in place
    copied: list[str] = field(default_factory=list)  # decoder initializers copied into mtp.onnx.data

    def summary(self) -> str:
        level = f", accuracy_level {self.accuracy_level}" if self.precision == "int4" else ""
        copied = f"; copied {', '.join(self.copied)}" if self.copied else ""
        shared = ", ".join(self.shared) or "nothing"
        return f"wrote {self.path} ({self.precision}{level}); shares {shared} with the decoder{copied}"


def export_mtp(checkpoint: str | Path, export_dir: str | Path, precision: str | None = None) -> MTPExport:
    """Read the ``mtp.*`` head of ``checkpoint`` and write it beside the decoder export in ``export_dir``."""
    geometry, weights = read_mtp_checkpoint(checkpoint)
    return write_mtp_head(export_dir, geometry, weights, precision)


def write_mtp_head(
    export_dir: str | Path,
    geometry: MTPGeometry,
    weights: Mapping[str, np.ndarray],
    precision: str | None = None,
) -> MTPExport:
    """Write ``mtp.onnx`` for head ``weights`` (checkpoint naming) beside the decoder in ``export_dir``."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} (got {precision!r})")
    check_weights(geometry, weights, "the MTP weights")
    package = ModelPackage.open(export_dir)
    root = package.root
    section = ((package.genai_config or {}).get("model") or {}).get("mtp")
    if section is not None:  # onnxruntime-genai reads its own head through that section: leave it be
        raise ModelPackageError(
            f"{root} already has an MTP head (genai_config.json model.mtp, written by onnxruntime-genai's "
            "builder); onnxgen uses it as it is, so there is nothing to export"
        )
    decoder = ir.load(str(package.model_path))
    io = package.io
    embedding = _borrow_embedding(decoder, io.token_input, package.model_path)
    lm_head = _borrow_lm_head(decoder, package, geometry)
    level = _accuracy_level(decoder)
    precision = precision or ("int4" if level is not None else "fp32")
    level = level if level is not None else DEFAULT_ACCURACY_LEVEL
    quantize: Quantize | None = quantize_int4 if precision == "int4" else None
    rotary = _rotary_caches(decoder, geometry, package.context_length)
    model = build_mtp_graph(geometry, weights, embedding, lm_head, rotary, quantize, level)
    report = MTPExport(root / MTP_FILE, precision, level if precision == "int4" else None)
    own = []
    for value in model.graph.initializers.values():
        tensor = value.const_value
        assert tensor is not None
        if _shareable(tensor, root):
            report.shared.append(str(value.name))
            continue
        if value.name in _borrowed_names(embedding, lm_head) | _rotary_names(rotary):
            report.copied.append(str(value.name))
        if tensor.nbytes >= EXTERNAL_MIN_BYTES:  # small constants (shapes, axes) stay in the graph
            own.append(value)
    # the head's own tensors (and copied ones) go to mtp.onnx.data; shared ones keep pointing into the
    # decoder's data file, which the head reads from the same directory
    stored = ir.external_data.convert_tensors_to_external(
        [v.const_value for v in own],  # type: ignore[misc]
        base_dir=root,
        relative_path=MTP_DATA,
    )
    for value, tensor in zip(own, stored, strict=True):
        value.const_value = tensor
    ir.save(model, str(report.path))
    return report


def _shareable(tensor: ir.TensorProtocol, root: Path) -> bool:
    """An external tensor in a data file of the export directory (not the head's own file)."""
    if not isinstance(tensor, ir.ExternalTensor):
        return False
    location = Path(os.fspath(tensor.location))
    path = root / location
    if path.is_file() and path.resolve().parent != root.resolve():
        # onnxruntime (and onnx-ir) read no external data from outside the model's directory
        raise ModelPackageError(
            f"{path} links to {path.resolve()}, outside {root}; onnxruntime reads no weights from outside "
            "a model's directory: copy the export's files into one directory instead of linking them"
        )
    return len(location.parts) == 1 and location.name != MTP_DATA and path.is_file()


def _borrowed_names(*nodes: Borrowed) -> set[str]:
    tensors = [t.tensor if isinstance(t, Transposed) else t for b in nodes for t in b.inputs]
    return {str(t.name) for t in tensors if t is not None}


def _rotary_names(rotary: RotaryCaches | None) -> set[str]:
    return set() if rotary is None else {str(rotary.cos.name), str(rotary.sin.name)}


_ROTARY_USERS = {  # (domain, op) -> input indices of cos_cache and sin_cache
    (MS, "GroupQueryAttention"): (7, 8),
    (MS, "RotaryEmbedding"): (2, 3),
    (MS, "MRotaryEmbedding"): (2, 3),
    ("", "RotaryEmbedding"): (1, 2),  # opset 23: X, cos_cache, sin_cache, position_ids
}


def _rotary_caches(decoder: ir.Model, g: MTPGeometry, context_length: int | None) -> RotaryCaches | None:
    """GroupQueryAttention's rotary caches for the head: the decoder's where they are the head's (same
    width and the head's values at every position, so shared in place like the embedding), else the
    head's own over ``context_length`` rows; None (rotary nodes on the position ids, which bound no
    length) where onnxruntime's kernel cannot apply a rotary of the head's width, or where neither the
    decoder's tables nor a stated context length say how many positions the caches must hold."""
    if not fused_rotary_fits(g):
        return None
    for node in decoder.graph.all_nodes():
        slots = _ROTARY_USERS.get((node.domain, node.op_type))
        if slots is None or max(slots) >= len(node.inputs):
            continue
        values = [node.inputs[i] for i in slots]
        tensors = [v.const_value if v is not None else None for v in values]
        if any(t is None or t.dtype != ir.DataType.FLOAT for t in tensors):
            continue
        cos, sin = tensors
        assert cos is not None and sin is not None
        if tuple(cos.shape) != tuple(sin.shape) or len(cos.shape) != 2:
            continue
        positions, half = cos.shape.numpy()  # a constant's shape is static
        if half * 2 != g.rotary_dim:
            continue
        want = rotary_tables(g, int(positions))
        # the builder computes its tables in float32: angles differ by ~1e-7 times the position
        if all(np.allclose(t.numpy(), w, atol=1e-3) for t, w in zip((cos, sin), want, strict=True)):
            return RotaryCaches(cos, sin)
    return RotaryCaches.of(g, context_length) if context_length else None


def _transposed(value: ir.Value | None) -> Transposed | None:
    """``value`` as a Transpose of an initializer (how a builder export with tied embeddings reads its
    embedding table from the lm_head's weight), else None."""
    node = value.producer() if value is not None else None
    if node is None or (node.domain, node.op_type) != ("", "Transpose") or len(node.inputs) != 1:
        return None
    source, perm = node.inputs[0], node.attributes.get("perm")
    if source is None or source.const_value is None or perm is None:
        return None
    return Transposed(source.const_value, perm.as_ints())


def _tensors(node: ir.Node, fed: int, what: str) -> list[ir.TensorProtocol | Transposed | None]:
    """The node's inputs: None at index ``fed``, the initializer tensors (or initializers read through a
    Transpose) elsewhere."""
    out: list[ir.TensorProtocol | Transposed | None] = []
    for i, value in enumerate(node.inputs):
        if i == fed:
            out.append(None)
        elif (transposed := _transposed(value)) is not None:
            out.append(transposed)
        elif value is None or value.const_value is None:
            raise UnsupportedModelError(
                f"the decoder's {what} ({node.op_type} {node.name!r}) reads a computed value "
                f"{getattr(value, 'name', None)!r}, not a weight; onnxgen's MTP export reuses the decoder's "
                "embedding and lm_head only when they are plain weights"
            )
        else:
            out.append(value.const_value)
    return out


def _borrow_embedding(decoder: ir.Model, token_input: str, where: Path) -> Borrowed:
    ids = next((v for v in decoder.graph.inputs if v.name == token_input), None)
    users = [u for u, _ in ids.uses()] if ids is not None else []
    node = next((n for n in users if (n.domain, n.op_type) in _EMBEDDING_OPS), None)
    if node is None:
        raise UnsupportedModelError(
            f"{where}: no Gather reads the token input {token_input!r} directly, so the embedding table "
            "cannot be shared with an MTP head"
        )
    fed = next(i for i, v in enumerate(node.inputs) if v is ids)
    return Borrowed(
        node.op_type, node.domain, list(node.attributes.values()), _tensors(node, fed, "embedding")
    )


def _borrow_lm_head(decoder: ir.Model, package: ModelPackage, g: MTPGeometry) -> Borrowed:
    logits = package.io.logits
    proto, reason = find_lm_head(package.graph.graph, logits)
    if proto is None:
        raise UnsupportedModelError(f"{package.model_path}: the lm_head cannot be found: {reason}")
    if list(proto.output) != [logits]:
        raise UnsupportedModelError(
            f"{package.model_path}: the logits are computed from the lm_head's output by further nodes; "
            "onnxgen's MTP export needs an lm_head that writes the logits itself"
        )
    node = next(n for n in decoder.graph if [o.name for o in n.outputs] == [logits])
    tensors = _tensors(node, 0, "lm_head")
    k = node.attributes.get("K")
    weight = tensors[1] if len(tensors) > 1 else None
    if isinstance(weight, Transposed):
        rows: int | None = int(weight.tensor.shape.numpy()[weight.perm[0]])
    else:
        rows = int(weight.shape.numpy()[0]) if weight is not None else None
    hidden = k.as_int() if k is not None else rows
    if hidden is not None and int(hidden) != g.hidden:
        raise ModelPackageError(
            f"{package.model_path} has hidden size {hidden} but the MTP head has {g.hidden}; "
            "give the checkpoint this export was made from"
        )
    return Borrowed(node.op_type, node.domain, list(node.attributes.values()), tensors)


def _accuracy_level(decoder: ir.Model) -> int | None:
    """The decoder's MatMulNBits ``accuracy_level`` (None: the decoder has no int4 projection)."""
    for node in decoder.graph:
        if node.domain == MS and node.op_type == "MatMulNBits":
            attr = node.attributes.get("accuracy_level")
            return attr.as_int() if attr is not None else 0
    return None


def check_head(export_dir: str | Path) -> None:
    """Load the head beside the decoder in ``export_dir`` as the engine does and run one entry through
    it; raises what the engine would (a head that does not load, or does not fit the decoder)."""
    package = ModelPackage.open(export_dir)
    path = find_mtp_head(package)
    if path is None:
        raise ModelPackageError(f"{package.root} has no MTP head to check")
    head = MTPHeadSession(mtp_head_io(package, path), threads=1, fuse=False)
    state = head.new_state(1)
    hidden = np.zeros((1, 1, head.hidden_size), dtype=np.float32)
    logits, _ = head.forward(state, np.zeros((1, 1), dtype=np.int64), hidden)
    if not np.isfinite(logits).all():
        raise UnsupportedModelError(f"{path} gives non-finite logits on a first entry; re-export it")


__all__ = ["MTP_DATA", "MTP_FILE", "PRECISIONS", "MTPExport", "check_head", "export_mtp", "write_mtp_head"]
