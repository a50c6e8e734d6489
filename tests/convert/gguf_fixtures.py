"""Tiny GGUF files written with ``gguf``'s own writer, and a numpy forward pass in llama.cpp's conventions.

Weights start as known floats and are stored in the requested block type: through
``gguf.quants.quantize`` where gguf has a quantizer for it, else (the K-quants) as random blocks with
float16 scales of a sane size. The reference forward pass reads every weight back with
``gguf.quants.dequantize`` and follows llama.cpp: ``llama`` query/key rows are stored permuted for
interleaved RoPE (pairs ``2i, 2i+1``), ``qwen2`` / ``qwen3`` rows as trained with rotate-half RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

# float16 header fields of block types gguf cannot quantize: byte offsets in a block
_K_HEADERS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
# their scales (d, and dmin where the type has one): weights of std ~0.08 around 0, like real layers
_K_SCALE = {
    T.Q2_K: (4e-3, 6e-3),
    T.Q3_K: (2e-3,),
    T.Q4_K: (3e-4, 2.2e-3),
    T.Q5_K: (1.7e-4, 2.6e-3),
    T.Q6_K: (6e-5,),
}


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character table, in byte order."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


TOKENS = [*_byte_alphabet(), "Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@dataclass
class Spec:
    arch: str = "llama"
    qtype: T = T.Q4_0  # every projection's type (and the embedding's, tied or not)
    v_type: T | None = None  # the value projection's type, when it differs
    tied: bool = True
    hidden: int = 256
    intermediate: int = 512
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    theta: float = 10000.0
    eps: float = 1e-5
    seed: int = 0
    head_size: int | None = None  # {arch}.attention.key_length when it differs from hidden / heads
    rope_freqs: bool = False  # a rope_freqs.weight tensor (Llama 3.1-style frequency divisors)
    eot: int | None = None  # tokenizer.ggml.eot_token_id

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads


@dataclass
class TinyGGUF:
    path: Path
    spec: Spec
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # name -> gguf's dequantized [N, K]
    raw: dict[str, tuple[np.ndarray, T]] = field(default_factory=dict)  # name -> (stored blocks, type)


def _store(rng: np.random.Generator, w: np.ndarray, qtype: T) -> np.ndarray:
    if qtype in (T.F32,):
        return w.astype(np.float32)
    if qtype in (T.F16,):
        return w.astype(np.float16)
    if qtype not in _K_HEADERS:
        try:
            return quantize(w.astype(np.float32), qtype)
        except NotImplementedError:  # a type gguf only reads: random blocks (for refusal tests)
            pass
    elements, size = GGML_QUANT_SIZES[qtype]
    n_blocks = w.size // elements
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for at, size in zip(_K_HEADERS.get(qtype, ()), _K_SCALE.get(qtype, ()), strict=True):
        scale = (rng.uniform(0.5, 1.5, n_blocks) * size).astype(np.float16)
        raw[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(w.shape[0], -1)


def write_gguf(path: Path, spec: Spec) -> TinyGGUF:
    """A tiny decoder of ``spec`` at ``path``."""
    rng = np.random.default_rng(spec.seed)
    out = TinyGGUF(path, spec)
    writer = GGUFWriter(str(path), spec.arch)
    a = spec.arch
    writer.add_block_count(spec.layers)
    writer.add_context_length(128)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.intermediate)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_rope_freq_base(spec.theta)
    writer.add_layer_norm_rms_eps(spec.eps)
    writer.add_uint32(f"{a}.rope.dimension_count", spec.head_dim)
    if spec.head_size:
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * 256 + [1, 1, 1, 3, 3, 3])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(TOKENS.index("<|im_start|>"))
    writer.add_eos_token_id(TOKENS.index("<|im_end|>"))
    writer.add_pad_token_id(TOKENS.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    if spec.eot is not None:
        writer.add_eot_token_id(spec.eot)
    writer.add_chat_template(TEMPLATE)

    def tensor(name: str, shape: tuple[int, ...], qtype: T, scale: float = 0.08) -> None:
        w = (rng.standard_normal(shape) * scale).astype(np.float32)
        if len(shape) == 1:
            w = (1.0 + w).astype(np.float32)
            writer.add_tensor(name, w)
            out.weights[name] = w
            return
        stored = _store(rng, w, qtype)
        raw_dtype = qtype if stored.dtype == np.uint8 else None
        writer.add_tensor(name, stored, raw_dtype=raw_dtype)
        out.raw[name] = (stored, qtype)
        with np.errstate(invalid="ignore", over="ignore"):  # random blocks of refused types may hold NaNs
            values = dequantize(stored, qtype).reshape(shape) if raw_dtype else stored.astype(np.float32)
        out.weights[name] = values

    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    tensor("token_embd.weight", (len(TOKENS), spec.hidden), spec.qtype, 0.5)
    for i in range(spec.layers):
        p = f"blk.{i}"
        tensor(f"{p}.attn_norm.weight", (spec.hidden,), T.F32)
        tensor(f"{p}.attn_q.weight", (q, spec.hidden), spec.qtype)
        tensor(f"{p}.attn_k.weight", (kv, spec.hidden), spec.qtype)
        tensor(f"{p}.attn_v.weight", (kv, spec.hidden), spec.v_type or spec.qtype)
        if a == "qwen2":
            for name, n in (("q", q), ("k", kv), ("v", kv)):
                tensor(f"{p}.attn_{name}.bias", (n,), T.F32)
        if a == "qwen3":
            tensor(f"{p}.attn_q_norm.weight", (spec.head_dim,), T.F32)
            tensor(f"{p}.attn_k_norm.weight", (spec.head_dim,), T.F32)
        tensor(f"{p}.attn_output.weight", (spec.hidden, q), spec.qtype)
        tensor(f"{p}.ffn_norm.weight", (spec.hidden,), T.F32)
        tensor(f"{p}.ffn_gate.weight", (spec.intermediate, spec.hidden), spec.qtype)
        tensor(f"{p}.ffn_up.weight", (spec.intermediate, spec.hidden), spec.qtype)
        tensor(f"{p}.ffn_down.weight", (spec.hidden, spec.intermediate), spec.qtype)
    tensor("output_norm.weight", (spec.hidden,), T.F32)
    if spec.rope_freqs:  # divisors from 1 (high frequencies kept) to 8 (low ones slowed down)
        factors = np.geomspace(1.0, 8.0, spec.head_dim // 2).astype(np.float32)
        writer.add_tensor("rope_freqs.weight", factors)
        out.weights["rope_freqs.weight"] = factors
    if not spec.tied:
        tensor("output.weight", (len(TOKENS), spec.hidden), spec.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# -- reference forward pass (float64, llama.cpp conventions) -----------------------------------------------


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, theta: float, interleaved: bool, factors: np.ndarray | None = None) -> np.ndarray:
    """``x`` ``[seq, heads, dim]`` rotated by position: pairs ``(2i, 2i+1)`` or ``(i, i + dim/2)``;
    frequency ``i`` divided by ``factors[i]`` where given (llama.cpp's ``rope_freqs``)."""
    seq, _, dim = x.shape
    inv = theta ** (-np.arange(0, dim, 2) / dim)
    if factors is not None:
        inv = inv / factors
    ang = np.arange(seq)[:, None, None] * inv[None, None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out
    a, b = x[..., : dim // 2], x[..., dim // 2 :]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)


def reference_logits(g: TinyGGUF, ids: list[int]) -> np.ndarray:
    """Logits ``[len(ids), vocab]`` of the GGUF's dequantized weights."""
    s, w = g.spec, {k: v.astype(np.float64) for k, v in g.weights.items()}
    x = w["token_embd.weight"][ids]
    n, hd = len(ids), s.head_dim
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(s.layers):
        p = f"blk.{i}"
        h = _rms(x, w[f"{p}.attn_norm.weight"], s.eps)
        qkv = []
        for name, heads in (("q", s.heads), ("k", s.kv_heads), ("v", s.kv_heads)):
            y = h @ w[f"{p}.attn_{name}.weight"].T + w.get(f"{p}.attn_{name}.bias", 0.0)
            y = y.reshape(n, heads, hd)
            if name != "v" and f"{p}.attn_{name}_norm.weight" in w:
                y = _rms(y, w[f"{p}.attn_{name}_norm.weight"], s.eps)
            if name != "v":
                y = _rope(y, s.theta, interleaved=s.arch == "llama", factors=w.get("rope_freqs.weight"))
            qkv.append(y)
        q, k, v = qkv
        rep = s.heads // s.kv_heads
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        att = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", att, v).reshape(n, -1)
        x = x + o @ w[f"{p}.attn_output.weight"].T
        h = _rms(x, w[f"{p}.ffn_norm.weight"], s.eps)
        gate, up = h @ w[f"{p}.ffn_gate.weight"].T, h @ w[f"{p}.ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[f"{p}.ffn_down.weight"].T
    x = _rms(x, w["output_norm.weight"], s.eps)
    return x @ w.get("output.weight", w["token_embd.weight"]).T
