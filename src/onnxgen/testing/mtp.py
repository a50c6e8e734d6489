"""Tiny MTP heads for tests: random ``mtp.*`` weights in the real checkpoints' naming, a NumPy reference of
the head's forward, and a head for the in-code decoders whose drafts the target mostly accepts.

Naming (Qwen3.5 / Qwen3-Next checkpoints; torch ``Linear`` weights ``[out, in]``): ``mtp.fc.weight``
``[hidden, 2*hidden]``, ``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight``,
``mtp.norm.weight`` ``[hidden]``, and one full-attention decoder layer under ``mtp.layers.0.``:
``input_layernorm``, ``post_attention_layernorm``, ``self_attn.{q,k,v,o}_proj`` (``q_proj`` yields the
query and an output gate per head: ``[heads*2*head_dim, hidden]``), ``self_attn.{q,k}_norm``
``[head_dim]``, ``mlp.{gate,up,down}_proj``. Norm weights are zero-centred: a norm multiplies by
``1 + weight``.

The reference follows the published MTP forward: ``fc(concat(norm_emb(embed(token t+1)), norm_hidden(h_t)))``
(embedding first), the decoder layer (pre-norm residual, gated attention with per-head q/k norms and partial
rotary, SwiGLU MLP), then ``mtp.norm``; the logits are the shared lm_head over that normed state, which is
also the hidden state the next chained step reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from onnxgen.export.mtp_weights import MTPGeometry
from onnxgen.testing.reference import causal_gqa
from onnxgen.testing.spec import TinySpec

_P = "mtp.layers.0."


def make_mtp_weights(g: MTPGeometry, seed: int = 0, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Random float32 ``mtp.*`` weights for geometry ``g`` (same arguments, same bits).

    Projections have std ``scale / sqrt(fan_in)``; norm weights are ``0.1 * N(0, 1)`` (zero-centred), so a
    head that forgot the ``1 +`` would not match the reference.
    """
    rng = np.random.default_rng(seed)

    def lin(n_out: int, n_in: int) -> np.ndarray:
        return (scale * rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    h, hd = g.hidden, g.head_dim
    return {
        "mtp.fc.weight": lin(h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": norm(h),
        "mtp.pre_fc_norm_hidden.weight": norm(h),
        "mtp.norm.weight": norm(h),
        _P + "input_layernorm.weight": norm(h),
        _P + "post_attention_layernorm.weight": norm(h),
        _P + "self_attn.q_proj.weight": lin(g.heads * 2 * hd, h),
        _P + "self_attn.k_proj.weight": lin(g.kv_heads * hd, h),
        _P + "self_attn.v_proj.weight": lin(g.kv_heads * hd, h),
        _P + "self_attn.o_proj.weight": lin(h, g.heads * hd),
        _P + "self_attn.q_norm.weight": norm(hd),
        _P + "self_attn.k_norm.weight": norm(hd),
        _P + "mlp.gate_proj.weight": lin(g.intermediate, h),
        _P + "mlp.up_proj.weight": lin(g.intermediate, h),
        _P + "mlp.down_proj.weight": lin(h, g.intermediate),
    }


def geometry_of(spec: TinySpec, rotary_dim: int | None = None) -> MTPGeometry:
    """The head geometry matching an in-code tiny decoder (rotary over a quarter of each head, as Qwen3.5)."""
    return MTPGeometry(
        hidden=spec.hidden,
        heads=spec.num_heads,
        kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        intermediate=spec.intermediate,
        vocab=spec.vocab_size,
        rms_eps=spec.rms_eps,
        rope_theta=spec.rope_theta,
        rotary_dim=rotary_dim if rotary_dim is not None else spec.head_dim // 4,
    )


def copying_mtp_weights(
    spec: TinySpec, final_norm: np.ndarray, seed: int = 0, noise: float = 0.05
) -> dict[str, np.ndarray]:
    """A head whose draft for token t+2 is (nearly) ``argmax lm_head(final_norm(embed(token t+1))))``.

    ``fc`` passes the normed embedding through (plus ``noise`` times a random map of the hidden state, so
    the head's KV depends on both inputs), the layer's output projections are ``noise`` times random and
    ``mtp.norm`` is the decoder's final norm weight: on a target whose layers add little to the residual
    stream (:func:`bigram_like`) the draft is the target's own next token most of the time, and not always.
    """
    g = geometry_of(spec)
    w = make_mtp_weights(g, seed=seed)
    h = spec.hidden
    fc = np.zeros((h, 2 * h), dtype=np.float32)
    fc[:, :h] = np.eye(h, dtype=np.float32)
    fc[:, h:] = noise * w["mtp.fc.weight"][:, h:]
    w["mtp.fc.weight"] = fc
    w["mtp.pre_fc_norm_embedding.weight"] = np.zeros(h, dtype=np.float32)
    w[_P + "self_attn.o_proj.weight"] *= np.float32(noise)
    w[_P + "mlp.down_proj.weight"] *= np.float32(noise)
    w["mtp.norm.weight"] = (final_norm - 1.0).astype(
        np.float32
    )  # the target's norm multiplies by w, not 1 + w
    return w


def bigram_like(weights: Mapping[str, np.ndarray], spec: TinySpec, strength: float) -> dict[str, np.ndarray]:
    """``weights`` with every layer's contribution to the residual stream scaled by ``strength``: the
    target's next token depends mostly on the current one (and still, a little, on the context and the
    recurrent states)."""
    out = dict(weights)
    for i, kind in enumerate(spec.types):
        p = f"layers.{i}."
        for name in (p + "mlp.down", p + ("attn.o" if kind == "attention" else "lin.out")):
            out[name] = (weights[name] * strength).astype(np.float32)
    return out


# -- the NumPy reference ---------------------------------------------------------------------------------


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _rotate(x: np.ndarray, positions: np.ndarray, rotary_dim: int, theta: float) -> np.ndarray:
    """Rotary embedding (halves rotated, HF ``rotate_half``) on the first ``rotary_dim`` of each head."""
    inv = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    f = positions[:, None].astype(np.float64) * inv
    cos = np.concatenate([np.cos(f), np.cos(f)], axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(f), np.sin(f)], axis=-1)[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    turned = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return np.concatenate([rot * cos + turned * sin, rest], axis=-1)


def mtp_reference(
    g: MTPGeometry,
    weights: Mapping[str, np.ndarray],
    embed: np.ndarray,
    lm_head: np.ndarray,
    tokens: np.ndarray,
    hidden: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The head over entries 0..T-1 at positions 0..T-1 (entry i pairs ``tokens[i]``, the token after
    position i, with ``hidden[i]``, the target's hidden state at i), causal, in float64.

    ``embed`` is ``[vocab, hidden]``, ``lm_head`` ``[hidden, vocab]`` (``x @ W``). Returns logits
    ``[T, vocab]``, the head's output hidden state ``[T, hidden]`` and its key and value caches
    ``[kv_heads, T, head_dim]`` (keys after the rotary embedding).
    """
    w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    t, hd, eps = len(tokens), g.head_dim, g.rms_eps
    e = _rms(embed[np.asarray(tokens)].astype(np.float64), w["mtp.pre_fc_norm_embedding.weight"], eps)
    hn = _rms(hidden.astype(np.float64), w["mtp.pre_fc_norm_hidden.weight"], eps)
    x = np.concatenate([e, hn], axis=-1) @ w["mtp.fc.weight"].T
    a = _rms(x, w[_P + "input_layernorm.weight"], eps)
    qg = (a @ w[_P + "self_attn.q_proj.weight"].T).reshape(t, g.heads, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(t, g.heads * hd)
    q = _rms(q, w[_P + "self_attn.q_norm.weight"], eps)
    k = _rms(
        (a @ w[_P + "self_attn.k_proj.weight"].T).reshape(t, g.kv_heads, hd),
        w[_P + "self_attn.k_norm.weight"],
        eps,
    )
    v = (a @ w[_P + "self_attn.v_proj.weight"].T).reshape(t, g.kv_heads, hd)
    pos = np.arange(t)
    q, k = _rotate(q, pos, g.rotary_dim, g.rope_theta), _rotate(k, pos, g.rotary_dim, g.rope_theta)
    ctx = causal_gqa(q, k, v)
    x = x + (ctx / (1.0 + np.exp(-gate))) @ w[_P + "self_attn.o_proj.weight"].T
    m = _rms(x, w[_P + "post_attention_layernorm.weight"], eps)
    gate_mlp = m @ w[_P + "mlp.gate_proj.weight"].T
    x = (
        x
        + (gate_mlp / (1.0 + np.exp(-gate_mlp)) * (m @ w[_P + "mlp.up_proj.weight"].T))
        @ w[_P + "mlp.down_proj.weight"].T
    )
    y = _rms(x, w["mtp.norm.weight"], eps)
    return y @ lm_head.astype(np.float64), y, k.transpose(1, 0, 2), v.transpose(1, 0, 2)


def add_mtp_to_checkpoint(checkpoint: str | Path, g: MTPGeometry, seed: int = 0) -> dict[str, np.ndarray]:
    """Add random ``mtp.*`` weights to the checkpoint's ``model.safetensors`` and ``mtp_num_hidden_layers: 1``
    to its config (where Qwen3.5 checkpoints keep them); return the weights."""
    import json

    from safetensors.numpy import load_file, save_file

    path = Path(checkpoint) / "model.safetensors"
    tensors = load_file(str(path))
    weights = make_mtp_weights(g, seed=seed)
    save_file({**tensors, **weights}, str(path), metadata={"format": "pt"})
    config_path = Path(checkpoint) / "config.json"
    config = json.loads(config_path.read_text())
    (config.get("text_config") or config)["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return weights


__all__ = [
    "add_mtp_to_checkpoint",
    "bigram_like",
    "copying_mtp_weights",
    "geometry_of",
    "make_mtp_weights",
    "mtp_reference",
]
