"""Reading an MTP head from a Hugging Face checkpoint: its geometry from ``config.json`` and its ``mtp.*``
tensors from the ``*.safetensors`` files (transformers drops them when it loads the model, so they are read
directly).

Qwen3.5 and Qwen3-Next checkpoints hold one head layer under ``mtp.layers.0.`` (a full-attention decoder
layer with a dense SwiGLU MLP); see :mod:`onnxgen.testing.mtp` for the names. A head whose layer has a
mixture-of-experts MLP, or more than one layer, is refused with the names that show it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from onnxgen.errors import ModelPackageError

LAYER = "mtp.layers.0."
HEAD_NAMES = (
    "mtp.fc.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
    LAYER + "input_layernorm.weight",
    LAYER + "post_attention_layernorm.weight",
    LAYER + "self_attn.q_proj.weight",
    LAYER + "self_attn.k_proj.weight",
    LAYER + "self_attn.v_proj.weight",
    LAYER + "self_attn.o_proj.weight",
    LAYER + "self_attn.q_norm.weight",
    LAYER + "self_attn.k_norm.weight",
    LAYER + "mlp.gate_proj.weight",
    LAYER + "mlp.up_proj.weight",
    LAYER + "mlp.down_proj.weight",
)


@dataclass(frozen=True)
class MTPGeometry:
    """What the head's graph needs besides its weights."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_eps: float
    rope_theta: float
    rotary_dim: int  # leading dims of each head that the rotary embedding turns (Qwen3.5: a quarter)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every head tensor's shape (torch ``Linear`` weights are ``[out, in]``)."""
        h, hd = self.hidden, self.head_dim
        norms = {
            n: (h,) for n in HEAD_NAMES if n.endswith("norm.weight") or "layernorm" in n or "pre_fc" in n
        }
        return {
            **norms,
            "mtp.fc.weight": (h, 2 * h),
            LAYER + "self_attn.q_proj.weight": (self.heads * 2 * hd, h),
            LAYER + "self_attn.k_proj.weight": (self.kv_heads * hd, h),
            LAYER + "self_attn.v_proj.weight": (self.kv_heads * hd, h),
            LAYER + "self_attn.o_proj.weight": (h, self.heads * hd),
            LAYER + "self_attn.q_norm.weight": (hd,),
            LAYER + "self_attn.k_norm.weight": (hd,),
            LAYER + "mlp.gate_proj.weight": (self.intermediate, h),
            LAYER + "mlp.up_proj.weight": (self.intermediate, h),
            LAYER + "mlp.down_proj.weight": (h, self.intermediate),
        }


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def geometry_from_config(config: Mapping[str, Any], where: str = "config.json") -> MTPGeometry:
    """The head geometry of a Qwen3.5 / Qwen3-Next ``config.json`` (its ``text_config`` when nested)."""
    c = _text_config(config)
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    try:
        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or hidden // heads)
        factor = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
        return MTPGeometry(
            hidden=hidden,
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate=int(c["intermediate_size"]),
            vocab=int(c["vocab_size"]),
            rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            rotary_dim=int(head_dim * factor),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelPackageError(
            f"{where} does not describe the model's geometry ({e!r} missing or malformed); "
            "give the directory of the Hugging Face checkpoint the export was made from"
        ) from e


def read_mtp_checkpoint(checkpoint: str | Path) -> tuple[MTPGeometry, dict[str, np.ndarray]]:
    """The head geometry and its ``mtp.*`` weights (float32) from a checkpoint directory."""
    root = Path(checkpoint).expanduser()
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ModelPackageError(f"{root} has no config.json; give the Hugging Face checkpoint directory")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelPackageError(f"{config_path} is not valid JSON ({e}); re-download the checkpoint") from e
    geometry = geometry_from_config(config, str(config_path))
    weights = _read_mtp_tensors(root)
    check_weights(geometry, weights, str(root))
    return geometry, weights


def _read_mtp_tensors(root: Path) -> dict[str, np.ndarray]:
    try:
        from safetensors import safe_open
    except ImportError as e:  # an optional dependency: only the exporter needs it
        raise ModelPackageError(
            "reading an MTP head from a checkpoint needs the safetensors package: pip install 'onnxgen[export]' (or safetensors)"
        ) from e
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise ModelPackageError(
            f"{root} has no *.safetensors files; give the Hugging Face checkpoint directory"
        )
    found: dict[str, np.ndarray] = {}
    for shard in shards:
        with safe_open(str(shard), framework="np") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                if name.startswith("mtp."):
                    found[name] = np.asarray(f.get_tensor(name), dtype=np.float32)
    if not found:
        raise ModelPackageError(
            f"{root} has no mtp.* tensors: this checkpoint ships no multi-token-prediction head "
            "(Qwen3.5 / Qwen3-Next checkpoints do; models without one cannot use MTP speculation)"
        )
    return found


def check_weights(g: MTPGeometry, weights: Mapping[str, np.ndarray], where: str) -> None:
    """Every head tensor is present with its expected shape; a head this exporter cannot build is named."""
    layers = sorted({n.split(".")[2] for n in weights if n.startswith("mtp.layers.")})
    if layers and layers != ["0"]:
        raise ModelPackageError(
            f"{where} has MTP layers {', '.join(layers)}; onnxgen exports heads of one layer (mtp.layers.0)"
        )
    if any(n.startswith(LAYER + "mlp.experts") or n.startswith(LAYER + "mlp.gate.") for n in weights):
        raise ModelPackageError(
            f"{where} has a mixture-of-experts MTP layer ({LAYER}mlp.experts.*); onnxgen exports heads "
            "with a dense MLP (Qwen3.5 dense checkpoints)"
        )
    expected = g.expected_shapes()
    missing = [n for n in expected if n not in weights]
    if missing:
        raise ModelPackageError(
            f"{where} lacks MTP tensors {', '.join(missing[:4])}; is the checkpoint complete?"
        )
    wrong = [
        f"{n} {tuple(weights[n].shape)} (expected {s})" for n, s in expected.items() if weights[n].shape != s
    ]
    if wrong:
        raise ModelPackageError(
            f"{where}: MTP tensors disagree with config.json: {'; '.join(wrong[:3])}; "
            "give the config.json of the same checkpoint"
        )


__all__ = ["HEAD_NAMES", "MTPGeometry", "check_weights", "geometry_from_config", "read_mtp_checkpoint"]
