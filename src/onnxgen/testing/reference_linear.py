"""Numpy reference of one Gated DeltaNet (Qwen3-Next / Qwen3.5) token mixer, token by token.

This is the ground truth the ONNX builders in :mod:`onnxgen.testing.linear` are checked against. It runs
the plain recurrence (no chunking) in float64 and returns float32, so it is more exact than any export.
"""

from __future__ import annotations

import numpy as np

from onnxgen.testing.spec import TinySpec

L2_EPS = 1e-6  # HF's l2norm: x * rsqrt(sum(x^2) + 1e-6)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def _l2norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def causal_conv_ref(
    mixed: np.ndarray, kernel: np.ndarray, conv_state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv + SiLU. ``mixed`` [B, T, C], ``kernel`` [C, 1, K], ``conv_state`` [B, C, K-1].

    Returns (activated [B, T, C], present conv state [B, C, K-1]).
    """
    t = mixed.shape[1]
    k = kernel.shape[-1]
    full = np.concatenate([conv_state, mixed.transpose(0, 2, 1)], axis=2)  # [B, C, K-1+T]
    out = sum(full[:, :, j : j + t] * kernel[None, :, 0, j, None] for j in range(k))
    present = full[:, :, full.shape[2] - (k - 1) :]
    return _silu(np.asarray(out)).transpose(0, 2, 1), present


def gated_delta_ref(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule over time. q, k [B, T, H, dk] (already normalised, q scaled), v [B, T, H, dv],
    g, beta [B, T, H], state [B, H, dk, dv]. Returns (o [B, T, H, dv], final state)."""
    s = state.copy()
    outs = []
    for t in range(q.shape[1]):
        s = s * np.exp(g[:, t])[:, :, None, None]
        u = np.einsum("bhkv,bhk->bhv", s, k[:, t])
        delta = beta[:, t][:, :, None] * (v[:, t] - u)
        s = s + np.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outs.append(np.einsum("bhkv,bhk->bhv", s, q[:, t]))
    return np.stack(outs, axis=1), s


def gated_deltanet_layer_ref(
    x: np.ndarray,
    w: dict[str, np.ndarray],
    spec: TinySpec,
    layer: int,
    conv_state: np.ndarray,
    rec_state: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One linear-attention token mixer.

    ``x`` [B, T, hidden] (already input-normed), ``conv_state`` [B, conv_dim, K-1],
    ``rec_state`` [B, Hv, dk, dv]. Returns (y [B, T, hidden] before the residual add,
    present conv state, present recurrent state), all float32.
    """
    p = f"layers.{layer}.lin."
    hk, hv = spec.lin_key_heads, spec.lin_value_heads
    dk, dv = spec.lin_key_dim, spec.lin_value_dim
    wd = {name: w[p + name].astype(np.float64) for name in ("qkv", "z", "a", "b", "conv", "A_log", "dt_bias")}
    xd = x.astype(np.float64)
    b, t, _ = x.shape

    act, conv_present = causal_conv_ref(xd @ wd["qkv"], wd["conv"], conv_state.astype(np.float64))
    q = act[..., : hk * dk].reshape(b, t, hk, dk)
    k = act[..., hk * dk : 2 * hk * dk].reshape(b, t, hk, dk)
    v = act[..., 2 * hk * dk :].reshape(b, t, hv, dv)
    heads = np.arange(hv) * hk // hv  # value head h reads key head floor(h * Hk / Hv)
    q = _l2norm(q)[:, :, heads] * dk**-0.5
    k = _l2norm(k)[:, :, heads]

    g = -np.exp(wd["A_log"]) * _softplus(xd @ wd["a"] + wd["dt_bias"])
    beta = 1.0 / (1.0 + np.exp(-(xd @ wd["b"])))
    o, rec_present = gated_delta_ref(q, k, v, g, beta, rec_state.astype(np.float64))

    z = (xd @ wd["z"]).reshape(b, t, hv, dv)
    o = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + spec.rms_eps)
    o = o * w[p + "norm"].astype(np.float64) * _silu(z)
    y = o.reshape(b, t, hv * dv) @ w[p + "out"].astype(np.float64)
    return y.astype(np.float32), conv_present.astype(np.float32), rec_present.astype(np.float32)
