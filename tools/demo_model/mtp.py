"""The demo model's multi-token-prediction (MTP) head, in the naming of Qwen3.5 / Qwen3-Next checkpoints.

The head drafts the token after next. At position ``t`` it reads the target's final hidden state ``h_t``
(the output of the model's final norm, the lm_head's input) and the embedding of token ``t+1``:

    x = fc(concat(pre_fc_norm_embedding(embed(token[t+1])), pre_fc_norm_hidden(h_t)))   # embedding first
    x = layers.0(x)            # one full-attention decoder layer with its own KV cache
    g = norm(x)                # the head's hidden state: what a chained draft step reads as its h
    logits = lm_head(g)        # the model's shared (tied) embedding matrix: predicts token t+2

The decoder layer is built like the model's own attention layers (pre-norm residual; ``q_proj`` yields the
query and a sigmoid output gate per head; RMSNorm over each head's query and key; rotary embedding;
grouped KV heads; SwiGLU MLP). Every RMSNorm multiplies by ``1 + weight`` (Qwen3.5's zero-centred norms).
Positions: the pair ``(h_t, token[t+1])`` is rotated at position ``t`` (vLLM's convention; only relative
positions matter inside the head, so any constant offset gives the same result).

:class:`MTPHead` is the trainable module (transformers' own ``Qwen3_5DecoderLayer``);
:func:`mtp_reference` is the same forward written out op by op, for checking an exported head against it.
Tensors are saved as ``mtp.*`` beside the model's own in the checkpoint's safetensors: transformers drops
them when it loads the model, so :func:`read_mtp_tensors` reads them directly.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

PREFIX = "mtp."


class MTPHead(nn.Module):
    """``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.0``, ``mtp.norm``
    (the attribute names are the checkpoint's, less the ``mtp.`` prefix)."""

    def __init__(self, text_config: Any) -> None:
        super().__init__()
        hidden, eps = text_config.hidden_size, text_config.rms_norm_eps
        layer_config = copy.deepcopy(text_config)
        layer_config.num_hidden_layers = 1
        layer_config.layer_types = ["full_attention"]
        layer_config._attn_implementation = "sdpa"  # causal without a mask (see forward)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_config, 0)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=eps)
        std = text_config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)

    def forward(self, next_embeds: Any, hidden: Any, position_embeddings: tuple[Any, Any]) -> Any:
        """``next_embeds`` (embeddings of tokens t+1) and ``hidden`` (h_t), both ``[batch, seq, hidden]``,
        over a whole sequence at once (causal attention, no cache) -> the head's normed hidden state."""
        x = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.layers[0](self.fc(x), position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(x)

    def checkpoint_tensors(self) -> dict[str, Any]:
        """The head's weights under their checkpoint names (``mtp.fc.weight``, ...)."""
        return {PREFIX + name: t.detach().contiguous() for name, t in self.state_dict().items()}


def _rms_norm(x: Any, weight: Any, eps: float) -> Any:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def _rotate(x: Any, cos: Any, sin: Any) -> Any:
    """Rotary embedding over the leading ``2 * cos.shape[-1]`` dims of each head (rotate-half pairing:
    dim ``i`` with dim ``i + rotary_dim / 2``)."""
    rot = 2 * cos.shape[-1]
    x1, x2, rest = x[..., : rot // 2], x[..., rot // 2 : rot], x[..., rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def mtp_reference(
    weights: Mapping[str, Any],
    config: Mapping[str, Any],
    embed_tokens: Any,
    hidden: Any,
    next_ids: Any,
    start: int = 0,
    past: tuple[Any, Any] | None = None,
) -> tuple[Any, Any, tuple[Any, Any]]:
    """The head's forward, op by op (float32; no transformers code), with a KV cache.

    ``weights``: the ``mtp.*`` tensors; ``config``: the text config (``hidden_size``,
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``rope_parameters``
    with ``rope_theta`` and ``partial_rotary_factor``); ``embed_tokens`` ``[vocab, hidden]`` (also the
    lm_head); ``hidden`` ``[batch, seq, hidden]``: the target's final-norm outputs ``h_t``; ``next_ids``
    ``[batch, seq]``: the tokens ``t+1``; ``start``: the position of the first row (``past``'s length);
    ``past``: the head's cached ``(key, value)``, each ``[batch, kv_heads, start, head_dim]`` (keys after
    the rotary embedding). Returns ``(logits [batch, seq, vocab], head hidden [batch, seq, hidden],
    (key, value) including the new rows)``.
    """
    w = {k.removeprefix(PREFIX): torch.as_tensor(v, dtype=torch.float32) for k, v in weights.items()}
    eps, heads, kv_heads = (
        config["rms_norm_eps"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    head_dim, rope = config["head_dim"], config["rope_parameters"]
    batch, seq, _ = hidden.shape
    embeds = torch.as_tensor(embed_tokens, dtype=torch.float32)
    x = (
        torch.cat(
            [
                _rms_norm(embeds[next_ids], w["pre_fc_norm_embedding.weight"], eps),
                _rms_norm(hidden.float(), w["pre_fc_norm_hidden.weight"], eps),
            ],
            dim=-1,
        )
        @ w["fc.weight"].T
    )
    p = "layers.0."
    a = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
    q, gate = (a @ w[p + "self_attn.q_proj.weight"].T).view(batch, seq, heads, 2 * head_dim).chunk(2, dim=-1)
    k = (a @ w[p + "self_attn.k_proj.weight"].T).view(batch, seq, kv_heads, head_dim)
    v = (a @ w[p + "self_attn.v_proj.weight"].T).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    q = _rms_norm(q, w[p + "self_attn.q_norm.weight"], eps).transpose(1, 2)
    k = _rms_norm(k, w[p + "self_attn.k_norm.weight"], eps).transpose(1, 2)
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / rope["rope_theta"] ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    angles = torch.arange(start, start + seq, dtype=torch.float32)[:, None] * inv_freq
    q, k = _rotate(q, angles.cos(), angles.sin()), _rotate(k, angles.cos(), angles.sin())
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    kk, vv = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = q @ kk.transpose(-1, -2) * head_dim**-0.5
    future = torch.arange(start + seq)[None, :] > torch.arange(start, start + seq)[:, None]
    attn = scores.masked_fill(future, float("-inf")).softmax(-1) @ vv
    attn = attn.transpose(1, 2).reshape(batch, seq, heads * head_dim) * torch.sigmoid(
        gate.reshape(batch, seq, -1)
    )
    x = x + attn @ w[p + "self_attn.o_proj.weight"].T
    m = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
    gated = nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
    x = x + gated @ w[p + "mlp.down_proj.weight"].T
    out = _rms_norm(x, w["norm.weight"], eps)
    return out @ embeds.T, out, (k, v)


def write_mtp_tensors(path: Path, tensors: Mapping[str, Any]) -> None:
    """Add ``tensors`` (``mtp.*`` names) to the safetensors file ``path`` (created when absent)."""
    from safetensors.torch import load_file, save_file

    merged = load_file(str(path)) if path.is_file() else {}
    merged.update({name: t.detach().float().contiguous() for name, t in tensors.items()})
    save_file(merged, str(path), metadata={"format": "pt"})


def read_mtp_tensors(checkpoint_dir: Path) -> dict[str, Any]:
    """The ``mtp.*`` tensors of every ``*.safetensors`` file of ``checkpoint_dir``."""
    from safetensors import safe_open

    found: dict[str, Any] = {}
    for shard in sorted(checkpoint_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            found.update({n: f.get_tensor(n) for n in f.keys() if n.startswith(PREFIX)})  # noqa: SIM118
    return found
