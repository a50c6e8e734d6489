"""Tiny deterministic random-weight decoders in every export family, for tests and toy runs.

The engine never imports this package; tests and users who want a toy model do::

    from onnxgen.testing import TinySpec, build_model
    model_dir = build_model(tmp_path / "m", "hybrid-mobius", TinySpec.hybrid())

Families (see :mod:`onnxgen.testing.families`): ``genai-dense``, ``standard-dense``, ``hybrid-genai``,
``hybrid-mobius``, ``hybrid-scan``. Models built from one spec compute the same function;
:func:`reference_logits` is their numpy ground truth and :func:`run_teacher_forced` a plain onnxruntime loop
(batched prefill + cached decode steps) to run any of them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from onnxgen.testing.families import INDEX_DTYPES, KV_FORMS, STYLES, Variant, build_graph
from onnxgen.testing.graph import save_model
from onnxgen.testing.loop import run_teacher_forced
from onnxgen.testing.packaging import CONFIGS, write_package
from onnxgen.testing.reference import reference_logits
from onnxgen.testing.spec import TinySpec, make_weights
from onnxgen.testing.tokenizer import (
    CHAT_TEMPLATE,
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    special_token_ids,
    tiny_tokenizer,
)

FAMILIES = ("genai-dense", "standard-dense", "hybrid-genai", "hybrid-mobius", "hybrid-scan")
# Built on request only (not one of the families every test runs over): hybrid-genai with its
# LinearAttention rewritten into Scans, whose fused conv and norm the fast-ops pass rewrites.
EXTRA_FAMILIES = ("hybrid-genai-scan",)
# (family, kv, index_dtype) of every variant build_model makes beside the families' own form.
VARIANTS: tuple[tuple[str, str, str], ...] = tuple(
    (family, kv, dtype)
    for family in FAMILIES
    for kv, dtype in (("stacked", "int64"), ("static", "int64"), ("split", "int32"))
    if not (kv == "static" and STYLES[family].attention == "gqa")
)
PRECISIONS = ("fp32", "int4")

# Every file build_model may write (stale ones are removed first so a rebuild never mixes families).
_PACKAGE_FILES = (
    "model.onnx",
    "model.onnx.data",
    "genai_config.json",
    "config.json",
    "generation_config.json",
    "inference_metadata.yaml",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _check_args(family: str, spec: TinySpec, precision: str, config: str, variant: Variant) -> None:
    if family not in FAMILIES + EXTRA_FAMILIES:
        choices = ", ".join(FAMILIES + EXTRA_FAMILIES)
        raise ValueError(f"family={family!r} is not an export family; choose one of {choices}")
    style = STYLES[family]
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; choose one of {', '.join(PRECISIONS)}")
    if precision == "int4" and style.plain_onnx:
        raise ValueError(
            f"precision='int4' needs com.microsoft MatMulNBits, but family {family!r} is plain ONNX; "
            "use precision='fp32' or a genai/mobius family"
        )
    if variant.kv not in KV_FORMS:
        raise ValueError(f"kv={variant.kv!r} is not a KV layout; choose one of {', '.join(KV_FORMS)}")
    if variant.index_dtype not in INDEX_DTYPES:
        raise ValueError(f"index_dtype={variant.index_dtype!r} is not one of {', '.join(INDEX_DTYPES)}")
    if variant.kv == "static" and style.attention == "gqa":
        raise ValueError(
            f"family {family!r} uses GroupQueryAttention, whose fixed-length cache is the shared past/present "
            "buffer it already has; kv='static' is for the plain and Attention-24 families"
        )
    if config not in CONFIGS:
        raise ValueError(f"config={config!r} is not supported; choose one of {', '.join(CONFIGS)} (or None)")
    if style.hybrid and not spec.linear_layers:
        raise ValueError(f"family {family!r} needs linear layers in the spec; use TinySpec.hybrid(...)")
    if not style.hybrid and spec.linear_layers:
        raise ValueError(f"family {family!r} is dense but the spec has linear layers {spec.linear_layers}")
    if spec.vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"TinySpec.vocab_size={spec.vocab_size} is below the {MIN_VOCAB_SIZE} ids a byte-level tokenizer "
            "needs (256 bytes + 3 specials); raise it"
        )
    if spec.head_dim % 2:
        raise ValueError(f"TinySpec.head_dim must be even for rotary embeddings, got {spec.head_dim}")
    if style.attention == "gqa" and spec.attention_layers and spec.head_dim % 16:
        raise ValueError(
            f"family {family!r} uses GroupQueryAttention, which needs head_dim a multiple of 16; "
            f"got TinySpec.head_dim={spec.head_dim}"
        )


def build_model(
    out_dir: str | Path,
    family: str,
    spec: TinySpec | None = None,
    *,
    precision: str = "fp32",
    config: str | None = None,
    kv: str = "split",
    index_dtype: str = "int64",
    weights: dict[str, np.ndarray] | None = None,
) -> Path:
    """Build the tiny decoder of ``family`` into ``out_dir`` and return that model directory.

    ``spec`` defaults to ``TinySpec()`` (dense) or ``TinySpec.hybrid()`` (hybrid families). ``precision``
    is ``"fp32"`` or ``"int4"`` (MatMulNBits projections; genai and mobius families). ``config`` is
    ``"genai"``, ``"metadata"`` or ``"none"``; None picks the family's own (genai for the genai families,
    metadata for mobius/scan, none for standard-dense). ``kv`` (``"split"``, ``"stacked"``, ``"static"``)
    and ``index_dtype`` (``"int64"``, ``"int32"``) pick a variant (:mod:`onnxgen.testing.families`).
    ``weights`` replaces ``make_weights(spec)`` (same names and shapes). Same arguments give
    byte-identical files.
    """
    style = STYLES.get(family)
    if spec is None:
        spec = TinySpec.hybrid() if style is not None and style.hybrid else TinySpec()
    config = config if config is not None else (style.default_config if style is not None else "none")
    variant = Variant(kv, index_dtype)  # type: ignore[arg-type]
    _check_args(family, spec, precision, config, variant)
    assert style is not None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in _PACKAGE_FILES:
        (out / name).unlink(missing_ok=True)
    chosen = weights if weights is not None else make_weights(spec)
    model, ports = build_graph(family, spec, chosen, precision, variant)  # type: ignore[arg-type]
    save_model(model, out)
    write_package(out, spec, style, ports, config)
    return out


def poison_weights(model_dir: str | Path) -> Path:
    """Overwrite every floating-point weight of the model in ``model_dir`` with NaN: a broken export, for
    tests of what the engine does with non-finite outputs. Returns ``model_dir``."""
    out = Path(model_dir)
    model = onnx.load(str(out / "model.onnx"))
    for tensor in model.graph.initializer:
        weights = numpy_helper.to_array(tensor)
        if np.issubdtype(weights.dtype, np.floating):
            tensor.CopyFrom(numpy_helper.from_array(np.full_like(weights, np.nan), tensor.name))
    (out / "model.onnx.data").unlink(missing_ok=True)
    save_model(model, out)
    return out


def poison_positions(model_dir: str | Path, start: int) -> Path:
    """Set the rows ``start`` and on of the model's rotary tables (initializers named ``*cos_cache`` /
    ``*sin_cache``) to NaN: a model whose logits are finite for positions before ``start`` and NaN from
    there on, for tests of non-finite logits that appear mid-decode. Returns ``model_dir``."""
    out = Path(model_dir)
    model = onnx.load(str(out / "model.onnx"))
    poisoned = 0
    for tensor in model.graph.initializer:
        if tensor.name.endswith(("cos_cache", "sin_cache")):
            table = numpy_helper.to_array(tensor).copy()
            table[start:] = np.nan
            tensor.CopyFrom(numpy_helper.from_array(table, tensor.name))
            poisoned += 1
    if not poisoned:
        raise ValueError(f"{out / 'model.onnx'} has no cos_cache / sin_cache initializer to poison")
    (out / "model.onnx.data").unlink(missing_ok=True)
    save_model(model, out)
    return out


def bias_logits(model_dir: str | Path, biases: dict[int, float]) -> Path:
    """Add ``biases`` (token id -> logit offset) to the ``logits`` output of the model in ``model_dir``:
    a random model made to favour some tokens (say, a tag that ends a thinking section), for tests that
    need it to write them from a server process. Returns ``model_dir``."""
    out = Path(model_dir)
    model = onnx.load(str(out / "model.onnx"))
    graph = model.graph
    logits = next(o for o in graph.output if o.name == "logits")
    vocab = logits.type.tensor_type.shape.dim[-1].dim_value
    bias = np.zeros(vocab, dtype=np.float32)
    for token, value in biases.items():
        bias[token] = value
    for node in graph.node:
        node.output[:] = ["logits_unbiased" if name == "logits" else name for name in node.output]
    graph.initializer.append(numpy_helper.from_array(bias, "logits_bias"))
    graph.node.append(onnx.helper.make_node("Add", ["logits_unbiased", "logits_bias"], ["logits"]))
    (out / "model.onnx.data").unlink(missing_ok=True)
    save_model(model, out)
    return out


def int8_activations(model_dir: str | Path) -> Path:
    """Set every MatMulNBits of the int4 model in ``model_dir`` to int8 activations (``accuracy_level``
    4, as the onnxruntime-genai builder writes int4 models): onnxruntime then computes a single row
    differently from a block of rows, which batch-invariance tests need. Returns ``model_dir``."""
    out = Path(model_dir)
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            node.attribute.append(onnx.helper.make_attribute("accuracy_level", 4))
    onnx.save(model, str(out / "model.onnx"))
    return out


__all__ = [
    "CHAT_TEMPLATE",
    "CONFIGS",
    "EXTRA_FAMILIES",
    "FAMILIES",
    "KV_FORMS",
    "PRECISIONS",
    "SPECIAL_TOKENS",
    "VARIANTS",
    "TinySpec",
    "bias_logits",
    "build_model",
    "int8_activations",
    "make_weights",
    "poison_positions",
    "poison_weights",
    "reference_logits",
    "run_teacher_forced",
    "special_token_ids",
    "tiny_tokenizer",
]
