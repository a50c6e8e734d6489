"""Tiny random-weight Hugging Face checkpoints, and exports of them by onnxruntime-genai's model builder.

Everything is built locally (no hub access): a config object in code, ``from_config`` under a fixed
torch seed, ``save_pretrained`` in float32, plus a small byte-level BPE tokenizer trained on embedded
text. Families: Qwen3, Llama, Qwen2, Gemma2 (sliding-window and global layers, logit soft-capping), Phi-3
(dense), Qwen3.5 (hybrid: Gated DeltaNet layers with one full-attention layer in every four, saved through
``Qwen3_5ForConditionalGeneration`` as the builder expects; ``qwen3_5_text`` is the text model alone, as
mobius builds it), LFM2 (short-convolution layers beside attention) and Qwen3-Next (Gated DeltaNet and
mixture-of-experts). Exports: :func:`export_with_genai_builder` (onnxruntime-genai's model builder) and
:func:`export_with_mobius` (mobius-onnx).

torch, transformers and onnxruntime-genai are imported lazily, so this module imports without them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from onnxgen.errors import OnnxgenError
from onnxgen.testing._hf_tokenizer import save_tokenizer

Size = Literal["tiny", "bench"]
Precision = Literal["fp32", "int4"]
Family = Literal["qwen3", "llama", "qwen3_5", "qwen3_5_text", "qwen2", "gemma2", "phi3", "lfm2", "qwen3_next"]

__all__ = [
    "SIZES",
    "GenaiBuilderError",
    "HFSize",
    "MobiusError",
    "build_hf_checkpoint",
    "build_llama_checkpoint",
    "build_qwen3_5_checkpoint",
    "build_qwen3_checkpoint",
    "export_with_genai_builder",
    "export_with_mobius",
]


class GenaiBuilderError(OnnxgenError):
    """onnxruntime-genai's model builder failed or is not installed."""


@dataclass(frozen=True)
class HFSize:
    """Geometry shared by every family at one size (Qwen3.5 adds its linear-attention geometry)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_position: int
    # Gated DeltaNet geometry (Qwen3.5 only).
    lin_key_heads: int
    lin_value_heads: int
    lin_key_dim: int
    lin_value_dim: int
    # Qwen3.5 mRoPE: sections over head_dim * 0.25 / 2 rotary frequencies (text rows are identical).
    mrope_section: tuple[int, int, int]


SIZES: dict[str, HFSize] = {
    "tiny": HFSize(
        hidden=64,
        layers=4,
        heads=4,
        kv_heads=2,
        head_dim=32,
        intermediate=128,
        vocab=512,
        max_position=512,
        lin_key_heads=2,
        lin_value_heads=4,
        lin_key_dim=16,
        lin_value_dim=32,  # != key dim, so the recurrent state's axis order is visible in its shape
        mrope_section=(2, 1, 1),
    ),
    "bench": HFSize(
        hidden=512,
        layers=8,
        heads=8,
        kv_heads=2,
        head_dim=64,
        intermediate=1536,
        vocab=32000,
        max_position=4096,
        lin_key_heads=4,
        lin_value_heads=8,
        lin_key_dim=64,
        lin_value_dim=64,
        mrope_section=(3, 3, 2),
    ),
}

# Token ids of the special tokens every checkpoint's tokenizer carries (see _hf_tokenizer).
EOS_ID = 0  # <|endoftext|>, also pad
BOS_ID = 1  # <|im_start|>


def _size(size: Size | HFSize) -> HFSize:
    if isinstance(size, HFSize):
        return size
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not one of {sorted(SIZES)}; pass 'tiny', 'bench' or an HFSize")
    return SIZES[size]


def _common(s: HFSize) -> dict[str, Any]:
    return {
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "max_position_embeddings": s.max_position,
        "rms_norm_eps": 1e-6,
        # Weights of std ~ 1/sqrt(hidden) give unit-scale logits, so greedy picks are far from ties.
        "initializer_range": s.hidden**-0.5,
        "tie_word_embeddings": False,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
    }


def _save(model_cls: Any, config: Any, out_dir: Path, s: HFSize, seed: int, dtype: str = "float32") -> Path:
    import torch

    torch.manual_seed(seed)
    model = model_cls._from_config(config, dtype=getattr(torch, dtype))
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir, s.vocab)
    return out_dir


def build_qwen3_checkpoint(
    out_dir: str | Path, size: Size | HFSize = "tiny", seed: int = 0, dtype: str = "float32"
) -> Path:
    """Save a random ``Qwen3ForCausalLM`` (q/k RMSNorm, fused-rotary GQA in the export) to ``out_dir``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    s = _size(size)
    config = Qwen3Config(
        **_common(s),
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        attention_bias=False,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    return _save(Qwen3ForCausalLM, config, Path(out_dir), s, seed, dtype)


def build_llama_checkpoint(
    out_dir: str | Path, size: Size | HFSize = "tiny", seed: int = 0, dtype: str = "float32"
) -> Path:
    """Save a random ``LlamaForCausalLM`` to ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = _size(size)
    config = LlamaConfig(
        **_common(s),
        bos_token_id=BOS_ID,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )
    config.architectures = ["LlamaForCausalLM"]
    return _save(LlamaForCausalLM, config, Path(out_dir), s, seed, dtype)


def build_qwen3_5_checkpoint(
    out_dir: str | Path,
    size: Size | HFSize = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    mtp: bool = False,
) -> Path:
    """Save a random hybrid ``Qwen3_5ForConditionalGeneration`` (text model + a minimal vision tower).

    Layers ``i % 4 == 3`` are full attention (gated q, q/k norm, partial interleaved mRoPE), the others
    Gated DeltaNet (conv kernel 4). The builder reads ``architectures[0]`` and collapses ``text_config``.
    ``mtp``: add a random multi-token-prediction head (``mtp.*`` tensors in the safetensors file,
    ``mtp_num_hidden_layers: 1``), which transformers ignores and exporters read directly
    (:func:`onnxgen.testing.mtp.add_mtp_to_checkpoint`).
    """
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    s = _size(size)
    text = _common(s)
    text.update(
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(s.layers)],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=s.lin_key_dim,
        linear_value_head_dim=s.lin_value_dim,
        linear_num_key_heads=s.lin_key_heads,
        linear_num_value_heads=s.lin_value_heads,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": list(s.mrope_section),
            "mrope_interleaved": True,
        },
    )
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": s.hidden,
        "num_position_embeddings": 16,
    }
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    out = _save(Qwen3_5ForConditionalGeneration, config, Path(out_dir), s, seed, dtype)
    if mtp:
        from onnxgen.export.mtp_weights import geometry_from_config
        from onnxgen.testing.mtp import add_mtp_to_checkpoint

        add_mtp_to_checkpoint(out, geometry_from_config(json.loads((out / "config.json").read_text())), seed)
    return out


def _qwen3_5_text_config(s: HFSize) -> dict[str, Any]:
    return {
        "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(s.layers)],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": s.lin_key_dim,
        "linear_value_head_dim": s.lin_value_dim,
        "linear_num_key_heads": s.lin_key_heads,
        "linear_num_value_heads": s.lin_value_heads,
    }


def build_qwen3_5_text_checkpoint(
    out_dir: str | Path, size: Size | HFSize = "tiny", seed: int = 0, dtype: str = "float32"
) -> Path:
    """Save a random hybrid ``Qwen3_5ForCausalLM`` (the text model alone, as mobius builds it)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    s = _size(size)
    rope = {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": list(s.mrope_section),
        "mrope_interleaved": True,
    }
    config = Qwen3_5TextConfig(**_common(s), **_qwen3_5_text_config(s), rope_parameters=rope)
    config.architectures = ["Qwen3_5ForCausalLM"]
    return _save(Qwen3_5ForCausalLM, config, Path(out_dir), s, seed, dtype)


def build_qwen2_checkpoint(
    out_dir: str | Path, size: Size | HFSize = "tiny", seed: int = 0, dtype: str = "float32"
) -> Path:
    """Save a random ``Qwen2ForCausalLM`` (q/k/v biases)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    s = _size(size)
    config = Qwen2Config(**{k: v for k, v in _common(s).items() if k != "head_dim"})
    config.architectures = ["Qwen2ForCausalLM"]
    return _save(Qwen2ForCausalLM, config, Path(out_dir), s, seed, dtype)


def build_gemma2_checkpoint(
    out_dir: str | Path, size: Size | HFSize = "tiny", seed: int = 0, dtype: str = "float32"
) -> Path:
    """Save a random ``Gemma2ForCausalLM``: sliding-window layers (window 64) alternating with global ones,
    attention and final logit soft-capping."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    s = _size(size)
    config = Gemma2Config(
        **_common(s), sliding_window=64, query_pre_attn_scalar=s.head_dim, bos_token_id=BOS_ID
    )
    config.architectures = ["Gemma2ForCausalLM"]
    return _save(Gemma2ForCausalLM, config, Path(out_dir), s, seed, dtype)


def build_phi3_checkpoint(
    out_dir: str | Path, size: Size | HFSize = "tiny", seed: int = 0, dtype: str = "float32"
) -> Path:
    """Save a random ``Phi3ForCausalLM`` (fused qkv and gate/up projections, no long-context RoPE)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    s = _size(size)
    common = {k: v for k, v in _common(s).items() if k != "head_dim"}
    config = Phi3Config(**common, original_max_position_embeddings=s.max_position, bos_token_id=BOS_ID)
    config.architectures = ["Phi3ForCausalLM"]
    return _save(Phi3ForCausalLM, config, Path(out_dir), s, seed, dtype)


def build_lfm2_checkpoint(
    out_dir: str | Path, size: Size | HFSize = "tiny", seed: int = 0, dtype: str = "float32"
) -> Path:
    """Save a random hybrid ``Lfm2ForCausalLM``: short-convolution layers (cache of 3) and attention layers
    alternating."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    s = _size(size)
    types = ["full_attention" if i % 2 else "conv" for i in range(s.layers)]
    common = {k: v for k, v in _common(s).items() if k != "head_dim"}
    config = Lfm2Config(**common, layer_types=types, conv_L_cache=3, bos_token_id=BOS_ID)
    config.architectures = ["Lfm2ForCausalLM"]
    return _save(Lfm2ForCausalLM, config, Path(out_dir), s, seed, dtype)


def build_qwen3_next_checkpoint(
    out_dir: str | Path, size: Size | HFSize = "tiny", seed: int = 0, dtype: str = "float32"
) -> Path:
    """Save a random ``Qwen3NextForCausalLM``: Gated DeltaNet and one full-attention layer in four, every
    MLP a mixture of 4 experts (2 per token) beside a shared expert. head_dim 64, so the partial rotary
    (a quarter) gives GroupQueryAttention a cos cache of 8."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    s = _size(size)
    config = Qwen3NextConfig(
        **{**_common(s), "head_dim": 64},
        **_qwen3_5_text_config(s),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
    )
    config.architectures = ["Qwen3NextForCausalLM"]
    return _save(Qwen3NextForCausalLM, config, Path(out_dir), s, seed, dtype)


_BUILDERS = {
    "qwen3": build_qwen3_checkpoint,
    "llama": build_llama_checkpoint,
    "qwen3_5": build_qwen3_5_checkpoint,
    "qwen3_5_text": build_qwen3_5_text_checkpoint,
    "qwen2": build_qwen2_checkpoint,
    "gemma2": build_gemma2_checkpoint,
    "phi3": build_phi3_checkpoint,
    "lfm2": build_lfm2_checkpoint,
    "qwen3_next": build_qwen3_next_checkpoint,
}


def build_hf_checkpoint(
    family: Family, out_dir: str | Path, size: Size | HFSize = "tiny", seed: int = 0, dtype: str = "float32"
) -> Path:
    """Dispatch to ``build_<family>_checkpoint``; ``dtype`` is the saved weights' torch dtype (``bfloat16``
    halves what the checkpoint and onnxruntime-genai's builder hold in memory for large layouts)."""
    if family not in _BUILDERS:
        raise ValueError(f"family={family!r} is not one of {sorted(_BUILDERS)}")
    return _BUILDERS[family](out_dir, size, seed, dtype)


def export_with_genai_builder(
    hf_dir: str | Path,
    out_dir: str | Path,
    precision: Precision = "fp32",
    *,
    cache_dir: str | Path | None = None,
    extra_options: dict[str, str] | None = None,
    timeout_s: float = 1800.0,
) -> Path:
    """Export ``hf_dir`` with ``python -m onnxruntime_genai.models.builder ... -e cpu``; return ``out_dir``.

    Raises :class:`GenaiBuilderError` with the tail of the builder's output when it fails or when
    ``out_dir`` has no ``model.onnx`` / ``genai_config.json`` afterwards. The builder re-saves the
    tokenizer through transformers' ``AutoTokenizer``, which names Qwen3.5's class ``Qwen3_5Tokenizer``;
    onnxruntime-genai 0.18 rejects that name, so it is rewritten to ``Qwen2Tokenizer`` (same BPE).
    """
    if precision not in ("fp32", "int4"):
        raise ValueError(f"precision={precision!r} is not one of 'fp32', 'int4'")
    hf_dir, out_dir = Path(hf_dir).resolve(), Path(out_dir).resolve()
    if not (hf_dir / "config.json").is_file():
        raise GenaiBuilderError(f"{hf_dir} has no config.json; build a checkpoint there first")
    cache = Path(cache_dir).resolve() if cache_dir else out_dir.with_name(out_dir.name + ".cache")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir)]
    cmd += ["-o", str(out_dir), "-p", precision, "-e", "cpu", "-c", str(cache)]
    if extra_options:
        cmd += ["--extra_options", *(f"{k}={v}" for k, v in extra_options.items())]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise GenaiBuilderError(f"model builder timed out after {timeout_s:.0f}s exporting {hf_dir}") from e
    missing = [f for f in ("model.onnx", "genai_config.json") if not (out_dir / f).is_file()]
    if proc.returncode or missing:
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).strip().splitlines()[-25:])
        why = f"exit code {proc.returncode}" if proc.returncode else f"no {', '.join(missing)} in {out_dir}"
        hint = (
            "; install the external extra (pip install onnxruntime-genai onnx-ir transformers torch)"
            if "No module named" in tail
            else ""
        )
        raise GenaiBuilderError(
            f"onnxruntime-genai model builder failed on {hf_dir} ({precision}, {why}){hint}\n"
            f"command: {' '.join(cmd)}\n--- builder output (tail) ---\n{tail}"
        )
    _fix_tokenizer_class(out_dir / "tokenizer_config.json")
    return out_dir


# tokenizer classes transformers writes that onnxruntime-genai 0.18 cannot load -> a class it can.
_GENAI_TOKENIZER_CLASS = {"Qwen3_5Tokenizer": "Qwen2Tokenizer"}


def _fix_tokenizer_class(path: Path) -> None:
    if not path.is_file():
        return
    cfg = json.loads(path.read_text())
    fixed = _GENAI_TOKENIZER_CLASS.get(cfg.get("tokenizer_class", ""))
    if fixed:
        cfg["tokenizer_class"] = fixed
        path.write_text(json.dumps(cfg, indent=2) + "\n")


class MobiusError(OnnxgenError):
    """mobius-onnx failed or is not installed."""


def export_with_mobius(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    ep: str | None = None,
    static_cache: bool = False,
    timeout_s: float = 1800.0,
) -> Path:
    """Export ``hf_dir`` with ``mobius build --config HF_DIR OUT --runtime onnx-genai`` (``--ep EP``,
    ``--static-cache``); return ``out_dir``. The package has ``model.onnx``, ``inference_metadata.yaml``
    (its ``model.io``) and the checkpoint's ``tokenizer.json``."""
    hf_dir, out_dir = Path(hf_dir).resolve(), Path(out_dir).resolve()
    cmd = [sys.executable, "-m", "mobius", "build", "--config", str(hf_dir), str(out_dir)]
    cmd += [
        "--runtime",
        "onnx-genai",
        *(["--ep", ep] if ep else []),
        *(["--static-cache"] if static_cache else []),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise MobiusError(f"mobius timed out after {timeout_s:.0f}s exporting {hf_dir}") from e
    if proc.returncode or not (out_dir / "model.onnx").is_file():
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).strip().splitlines()[-25:])
        raise MobiusError(
            f"mobius failed on {hf_dir} (exit code {proc.returncode})\ncommand: {' '.join(cmd)}\n"
            f"--- mobius output (tail) ---\n{tail}"
        )
    return out_dir
