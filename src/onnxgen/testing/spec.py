"""The shape of a tiny test decoder and its deterministic random weights.

Every export family in :mod:`onnxgen.testing` is built from a :class:`TinySpec` and the weights
:func:`make_weights` draws for it, so two families built from one spec and seed compute the same
function (up to float reassociation).

Weight names (all float32, ``x @ W`` convention, i.e. ``W`` is ``[in, out]``):

- ``embed``            [vocab, hidden]
- ``lm_head``          [hidden, vocab]
- ``final_norm``       [hidden]
- per layer ``L`` (prefix ``layers.L.``):
  - ``input_norm``, ``post_norm``  [hidden]
  - ``mlp.gate``, ``mlp.up`` [hidden, intermediate]; ``mlp.down`` [intermediate, hidden]
  - attention layers: ``attn.q`` [hidden, heads*head_dim], ``attn.k``/``attn.v`` [hidden, kv_heads*head_dim],
    ``attn.o`` [heads*head_dim, hidden]
  - linear (Gated DeltaNet) layers:
    ``lin.qkv`` [hidden, 2*Hk*dk + Hv*dv] (channel order q | k | v), ``lin.z`` [hidden, Hv*dv],
    ``lin.a``/``lin.b`` [hidden, Hv], ``lin.conv`` [conv_dim, 1, K] with conv_dim = 2*Hk*dk + Hv*dv,
    ``lin.A_log``/``lin.dt_bias`` [Hv], ``lin.norm`` [dv], ``lin.out`` [Hv*dv, hidden]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = 320
    hidden: int = 64
    intermediate: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    max_position: int = 256
    # Layer types: "attention" or "linear". Empty = all attention (dense).
    layer_types: tuple[str, ...] = field(default=())
    # Gated DeltaNet geometry (linear layers only).
    lin_key_heads: int = 2
    lin_value_heads: int = 4
    lin_key_dim: int = 16
    lin_value_dim: int = 16
    conv_kernel: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"TinySpec.layer_types has {len(self.layer_types)} entries for num_layers={self.num_layers}"
            )
        if self.lin_value_heads % self.lin_key_heads:
            raise ValueError("TinySpec.lin_value_heads must be a multiple of lin_key_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("TinySpec.num_heads must be a multiple of num_kv_heads")

    @property
    def types(self) -> tuple[str, ...]:
        return self.layer_types or ("attention",) * self.num_layers

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.types) if t == "attention"]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.types) if t == "linear"]

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_key_heads * self.lin_key_dim + self.lin_value_heads * self.lin_value_dim

    @classmethod
    def hybrid(cls, **kw: Any) -> TinySpec:
        """Qwen3.5-like layout: one full-attention layer in every four (layers 3, 7, ...)."""
        n = int(kw.pop("num_layers", 4))
        types = tuple("attention" if i % 4 == 3 else "linear" for i in range(n))
        return cls(num_layers=n, layer_types=types, **kw)


def make_weights(spec: TinySpec) -> dict[str, np.ndarray]:
    """Deterministic float32 weights for ``spec`` (same spec -> bit-identical weights)."""
    rng = np.random.default_rng(spec.seed)

    def mat(n_in: int, n_out: int) -> np.ndarray:
        return (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    h = spec.hidden
    w: dict[str, np.ndarray] = {
        "embed": rng.standard_normal((spec.vocab_size, h)).astype(np.float32),
        "final_norm": norm(h),
        "lm_head": mat(h, spec.vocab_size) * np.float32(4.0),
    }
    for i, kind in enumerate(spec.types):
        p = f"layers.{i}."
        w[p + "input_norm"] = norm(h)
        w[p + "post_norm"] = norm(h)
        w[p + "mlp.gate"] = mat(h, spec.intermediate)
        w[p + "mlp.up"] = mat(h, spec.intermediate)
        w[p + "mlp.down"] = mat(spec.intermediate, h)
        if kind == "attention":
            w[p + "attn.q"] = mat(h, spec.num_heads * spec.head_dim)
            w[p + "attn.k"] = mat(h, spec.num_kv_heads * spec.head_dim)
            w[p + "attn.v"] = mat(h, spec.num_kv_heads * spec.head_dim)
            w[p + "attn.o"] = mat(spec.num_heads * spec.head_dim, h)
        else:
            hv, dv = spec.lin_value_heads, spec.lin_value_dim
            w[p + "lin.qkv"] = mat(h, spec.conv_dim)
            w[p + "lin.z"] = mat(h, hv * dv)
            w[p + "lin.a"] = mat(h, hv)
            w[p + "lin.b"] = mat(h, hv)
            w[p + "lin.conv"] = (0.5 * rng.standard_normal((spec.conv_dim, 1, spec.conv_kernel))).astype(
                np.float32
            )
            w[p + "lin.A_log"] = np.log(rng.uniform(0.5, 4.0, hv)).astype(np.float32)
            w[p + "lin.dt_bias"] = (0.5 * rng.standard_normal(hv)).astype(np.float32)
            w[p + "lin.norm"] = norm(dv)
            w[p + "lin.out"] = mat(hv * dv, h)
    return w
