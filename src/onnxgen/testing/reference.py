"""Numpy ground truth of the tiny decoder every export family writes.

Runs one unpadded sequence in float64 over the whole prompt at once (no cache), so comparing an export's
prefill + cached decode steps with it checks the cache handling as well as the math. Linear (Gated
DeltaNet) layers use :func:`onnxgen.testing.reference_linear.gated_deltanet_layer_ref` from zero states.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxgen.testing.attention import rope_tables
from onnxgen.testing.spec import TinySpec


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Non-interleaved rotary on x [T, heads, hd] with cos/sin [T, hd/2]."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def causal_gqa(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal softmax attention of q ``[T, heads, hd]`` over k, v ``[T, kv_heads, hd]`` (kv heads shared by
    consecutive query heads), scaled by ``hd ** -0.5``; the context ``[T, heads * hd]``."""
    t, heads, hd = q.shape
    rep = heads // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = np.einsum("shd,thd->hst", q, k) * hd**-0.5
    scores = np.where(np.tril(np.ones((t, t), dtype=bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hst,thd->shd", probs, v).reshape(t, heads * hd)


def attention_ref(x: np.ndarray, w: dict[str, np.ndarray], spec: TinySpec, layer: int) -> np.ndarray:
    """Causal GQA self-attention with RoPE over positions 0..T-1; ``x`` [T, hidden] normed."""
    p = f"layers.{layer}.attn."
    t, hd = x.shape[0], spec.head_dim
    q = (x @ w[p + "q"]).reshape(t, spec.num_heads, hd)
    k = (x @ w[p + "k"]).reshape(t, spec.num_kv_heads, hd)
    v = (x @ w[p + "v"]).reshape(t, spec.num_kv_heads, hd)
    cos, sin = (a[:t].astype(np.float64) for a in rope_tables(hd, spec.rope_theta, spec.max_position))
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    return causal_gqa(q, k, v) @ w[p + "o"]


def _linear_ref(x: np.ndarray, w32: dict[str, np.ndarray], spec: TinySpec, layer: int) -> np.ndarray:
    from onnxgen.testing.reference_linear import gated_deltanet_layer_ref

    conv = np.zeros((1, spec.conv_dim, spec.conv_kernel - 1), dtype=np.float32)
    rec = np.zeros((1, spec.lin_value_heads, spec.lin_key_dim, spec.lin_value_dim), dtype=np.float32)
    out, _, _ = gated_deltanet_layer_ref(x[None].astype(np.float32), w32, spec, layer, conv, rec)
    return out[0].astype(np.float64)


def reference_logits(spec: TinySpec, weights: dict[str, np.ndarray], tokens: Sequence[int]) -> np.ndarray:
    """Logits [T, vocab] (float64) of the model at every position of the unpadded sequence ``tokens``."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    h = w["embed"][np.asarray(tokens, dtype=np.int64)]
    for layer, kind in enumerate(spec.types):
        p = f"layers.{layer}."
        x = _rms(h, w[p + "input_norm"], spec.rms_eps)
        if kind == "attention":
            h = h + attention_ref(x, w, spec, layer)
        else:
            h = h + _linear_ref(x, weights, spec, layer)
        x = _rms(h, w[p + "post_norm"], spec.rms_eps)
        gate = x @ w[p + "mlp.gate"]
        h = h + ((gate / (1.0 + np.exp(-gate))) * (x @ w[p + "mlp.up"])) @ w[p + "mlp.down"]
    return _rms(h, w["final_norm"], spec.rms_eps) @ w["lm_head"]
