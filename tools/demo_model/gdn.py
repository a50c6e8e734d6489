"""Faster CPU drop-ins for transformers' Gated DeltaNet kernels, used only while training the demo model.

transformers falls back to ``torch_chunk_gated_delta_rule`` (chunks of 64, two triangular solves per
layer) when flash-linear-attention is absent; on two CPU cores that fallback is most of a training
step. :func:`chunk_gated_delta_rule` computes the same function (same arguments, same results to float
rounding; ``tests/test_demo_model.py`` compares the two) with chunks of 32 and the unit-lower-triangular
inverse as a product of matrix squares, which is a handful of batched matmuls:
``(I - N)^-1 = (I + N)(I + N^2)(I + N^4)...`` for a strictly lower (nilpotent) ``N``.
:func:`causal_conv1d_fn` replaces the depthwise causal convolution before it: torch's CPU backward of a
grouped ``conv1d`` with one channel per group took 30% of a training step; the same sums as four
shifted multiply-adds cost almost nothing either way.
They change no weight or layer: the saved checkpoint is a stock Qwen3.5 one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CHUNK = 32


def _unit_lower_inverse(lower: Any) -> Any:
    """``(I + lower)^-1`` for a batch of strictly lower-triangular square matrices."""
    import torch

    size = lower.shape[-1]
    eye = torch.eye(size, dtype=lower.dtype, device=lower.device)
    power = -lower
    inverse = eye + power
    span = 2
    while span < size:
        power = power @ power
        inverse = inverse + inverse @ power
        span *= 2
    return inverse


def chunk_gated_delta_rule(
    query: Any,
    key: Any,
    value: Any,
    g: Any,
    beta: Any,
    chunk_size: int = CHUNK,
    initial_state: Any = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: Any,
) -> tuple[Any, Any]:
    """Gated delta rule over ``[batch, seq, heads, dim]`` inputs; same contract as transformers'
    ``torch_chunk_gated_delta_rule`` (q/k have Hk heads, v Hv heads; ``g`` is the log decay)."""
    import torch
    import torch.nn.functional as F

    dtype = query.dtype
    batch, length, k_heads, dk = key.shape
    v_heads, dv = value.shape[-2:]
    if k_heads != v_heads:
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    q, k, v = (x.transpose(1, 2).float() for x in (query, key, value))
    beta, g = beta.transpose(1, 2).float(), g.transpose(1, 2).float()
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * dk**-0.5
    size = chunk_size
    pad = (size - length % size) % size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    chunks = (length + pad) // size
    q, k, v = (x.reshape(batch, v_heads, chunks, size, -1) for x in (q, k, v))
    beta, g = beta.reshape(batch, v_heads, chunks, size), g.reshape(batch, v_heads, chunks, size)

    cum = g.cumsum(-1)
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    inverse = _unit_lower_inverse((k_beta @ k.transpose(-1, -2) * decay).tril(-1))
    new_values = inverse @ (v * beta.unsqueeze(-1))
    k_cumdecay = inverse @ (k_beta * cum.exp().unsqueeze(-1))
    intra = q @ k.transpose(-1, -2) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_decayed = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]

    state = q.new_zeros(batch, v_heads, dk, dv) if initial_state is None else initial_state.float()
    outs = []
    # unbind once: indexing chunk i inside the loop would make backward write a full-size zero
    # gradient per chunk (quadratic in the number of chunks)
    per_chunk = (x.unbind(2) for x in (new_values, k_cumdecay, q_decayed, intra, k_decayed, chunk_decay))
    for u, w, qd, attn, kd, cd in zip(*per_chunk, strict=True):
        v_new = u - w @ state
        outs.append(qd @ state + attn @ v_new)
        state = state * cd + kd.transpose(-1, -2) @ v_new
    out = torch.stack(outs, 2).reshape(batch, v_heads, -1, dv)[:, :, :length]
    return out.transpose(1, 2).contiguous().to(dtype), (state if output_final_state else None)


def causal_conv1d_fn(
    hidden_states: Any, weight: Any, bias: Any = None, activation: str | None = None, **_: Any
) -> Any:
    """Depthwise causal convolution of ``hidden_states [batch, channels, seq]`` with ``weight
    [channels, kernel]`` (zero history), then the activation; transformers' ``causal_conv1d_fn`` contract."""
    import torch.nn.functional as F

    kernel, length = weight.shape[-1], hidden_states.shape[-1]
    x = F.pad(hidden_states.to(weight.dtype), (kernel - 1, 0))
    out = x[..., :length] * weight[:, :1]
    for k in range(1, kernel):
        out = out + x[..., k : k + length] * weight[:, k : k + 1]
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = F.silu(out) if activation == "silu" else getattr(F, activation)(out)
    return out.to(hidden_states.dtype)


@contextmanager
def fast_gated_delta_rule() -> Iterator[None]:
    """Route transformers' Qwen3.5 chunked Gated DeltaNet through :func:`chunk_gated_delta_rule` and its
    causal convolution through :func:`causal_conv1d_fn`."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    originals = qwen.torch_chunk_gated_delta_rule, qwen.causal_conv1d_fn
    qwen.torch_chunk_gated_delta_rule, qwen.causal_conv1d_fn = chunk_gated_delta_rule, causal_conv1d_fn
    try:
        yield
    finally:
        qwen.torch_chunk_gated_delta_rule, qwen.causal_conv1d_fn = originals
