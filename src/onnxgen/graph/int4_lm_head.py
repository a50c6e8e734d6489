"""A drafter's lm_head as int4 ``MatMulNBits``: cheaper drafts, the same verified output.

A drafter's logits (an MTP head's) only choose draft tokens: the target verifies every draft with its own
logits, and rejection sampling takes the drafter's distribution as it is, so neither greedy output nor the
sampled distribution depends on how the drafter rounds. An MTP head reuses the decoder's lm_head, which on a
small fp32 model is most of what a head forward reads (the bundled model: 3 MB of 3.4 MB). This pass
makes it int4 ``MatMulNBits`` (symmetric, block 32, int8 activations: ``accuracy_level`` 4, onnxruntime's
own quantizer); what that saved and what it did to acceptance: docs/speculative-mtp.md, "Cost on the bundled model".

The pass replaces a plain float ``MatMul`` lm_head over a rank-2 initializer; the initializer stays (the
head's embedding may read it). Anything else (an lm_head already int4, a weight computed in the graph) is
left as it is, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxgen.graph.logits_to_keep import find_lm_head
from onnxgen.graph.passes import PassResult
from onnxgen.model.external_data import read_array

BLOCK_SIZE = 32
# a float [K, N] weight -> MatMulNBits' packed int4 blocks and scales
Quantize = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
DRAFT_ACCURACY_LEVEL = 4  # int8 activations: the drafter's rounding does not reach the output


def int4_lm_head(
    model: onnx.ModelProto, logits: str, base_dir: Path | None, quantize: Quantize
) -> PassResult[str]:
    """A copy of ``model`` whose lm_head (the node writing ``logits``) is int4 ``MatMulNBits``; or ``model``
    itself, unmodified, with why not as the report. ``base_dir`` resolves an external weight; ``quantize``
    turns a float ``[K, N]`` weight into MatMulNBits' packed ``[N, blocks, BLOCK_SIZE / 2]`` uint8 and
    ``[N, blocks]`` scales (:func:`onnxgen.runtime.int4.quantize_int4`)."""
    head, reason = find_lm_head(model.graph, logits)
    if head is None:
        return PassResult(model, False, reason)
    if (head.domain or "", head.op_type) != ("", "MatMul"):
        return PassResult(model, False, f"the lm_head is a {head.op_type} node already")
    weight = next((t for t in model.graph.initializer if t.name == head.input[1]), None)
    if weight is None or len(weight.dims) != 2 or weight.data_type != onnx.TensorProto.FLOAT:
        return PassResult(
            model, False, "the lm_head's weight is not a float [hidden, vocabulary] initializer"
        )
    packed, scales = quantize(read_array(weight, base_dir).astype(np.float32))
    k, n = weight.dims
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    index = next(i for i, node in enumerate(g.node) if list(node.output) == list(head.output))
    name = f"{head.name or head.output[0]}/onnxgen_int4"
    g.initializer.extend(
        [
            numpy_helper.from_array(packed, f"{name}.weight"),
            numpy_helper.from_array(scales.ravel(), f"{name}.scales"),
        ]
    )
    quantized = helper.make_node(
        "MatMulNBits",
        [head.input[0], f"{name}.weight", f"{name}.scales"],
        list(head.output),
        name=name,
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=BLOCK_SIZE,
        accuracy_level=DRAFT_ACCURACY_LEVEL,
    )
    g.node.remove(g.node[index])
    g.node.insert(index, quantized)
    if not any(op.domain == "com.microsoft" for op in out.opset_import):
        out.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return PassResult(out, True, "")


__all__ = ["BLOCK_SIZE", "DRAFT_ACCURACY_LEVEL", "Quantize", "int4_lm_head"]
