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

from onnxgen.testing.families import STYLES, build_graph
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


def _check_args(family: str, spec: TinySpec, precision: str, config: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not an export family; choose one of {', '.join(FAMILIES)}")
    style = STYLES[family]
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; choose one of {', '.join(PRECISIONS)}")
    if precision == "int4" and style.plain_onnx:
        raise ValueError(
            f"precision='int4' needs com.microsoft MatMulNBits, but family {family!r} is plain ONNX; "
            "use precision='fp32' or a genai/mobius family"
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
    weights: dict[str, np.ndarray] | None = None,
) -> Path:
    """Build the tiny decoder of ``family`` into ``out_dir`` and return that model directory.

    ``spec`` defaults to ``TinySpec()`` (dense) or ``TinySpec.hybrid()`` (hybrid families). ``precision``
    is ``"fp32"`` or ``"int4"`` (MatMulNBits projections; genai and mobius families). ``config`` is
    ``"genai"``, ``"metadata"`` or ``"none"``; None picks the family's own (genai for the genai families,
    metadata for mobius/scan, none for standard-dense). ``weights`` replaces ``make_weights(spec)`` (same
    names and shapes). Same arguments give byte-identical files.
    """
    style = STYLES.get(family)
    if spec is None:
        spec = TinySpec.hybrid() if style is not None and style.hybrid else TinySpec()
    config = config if config is not None else (style.default_config if style is not None else "none")
    _check_args(family, spec, precision, config)
    assert style is not None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in _PACKAGE_FILES:
        (out / name).unlink(missing_ok=True)
    chosen = weights if weights is not None else make_weights(spec)
    model, ports = build_graph(family, spec, chosen, precision)  # type: ignore[arg-type]
    save_model(model, out)
    write_package(out, spec, style, ports, config)
    return out


__all__ = [
    "CHAT_TEMPLATE",
    "CONFIGS",
    "FAMILIES",
    "PRECISIONS",
    "SPECIAL_TOKENS",
    "TinySpec",
    "build_model",
    "make_weights",
    "reference_logits",
    "run_teacher_forced",
    "special_token_ids",
    "tiny_tokenizer",
]
