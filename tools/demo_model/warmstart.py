"""Start training from an earlier demo model: the weights of its onnxruntime-genai fp32 export.

``--init-from DIR`` continues from a model this pipeline trained and exported (the previously bundled
one), so a training budget goes into improving it rather than into relearning it. The export's
initializers map back to the transformers checkpoint one to one (the builder transposes ``Linear``
weights, concatenates the attention layers' q/k/v and the Gated DeltaNet's in_proj_qkv rows unchanged,
stores Qwen3.5's zero-centred norms as ``1 + weight`` and ``A_log`` as ``-exp(A_log)``); a model built
from them reproduces the export's logits (checked on load).

When the configured MLP is narrower than the export's (a smaller model leaves room in the bundled files
for the MTP head), each layer keeps the ``intermediate`` channels that carry the most output on training
text: mean ``|silu(gate) * up|`` over a few training windows, times the norm of the channel's
``down_proj`` column. Training then recovers what the pruned channels carried.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from tools.demo_model.config import DemoConfig

CALIBRATION_STEP = 10**9  # batches drawn for pruning: a step number training never reaches
_OFFSET_NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")


def state_dict_from_export(export_dir: Path) -> dict[str, Any]:
    """The ``Qwen3_5ForCausalLM`` state dict (``model.*`` names, tied lm_head) of a builder fp32 export."""
    import onnx
    import torch
    from onnx import numpy_helper

    decoder = json.loads((export_dir / "genai_config.json").read_text())["model"]["decoder"]
    kv_rows = decoder["num_key_value_heads"] * decoder["head_size"]
    graph = onnx.load(str(export_dir / "model.onnx")).graph
    w = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in graph.initializer}
    state: dict[str, Any] = {"model.embed_tokens.weight": w["lm_head.MatMul.weight"].T.contiguous()}
    for name, tensor in w.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m is None:
            continue
        prefix, rest = f"model.layers.{m[1]}.", m[2]
        if rest == "final_norm_layernorm.weight":
            state["model.norm.weight"] = tensor - 1.0
        elif rest == "attn.qkv_proj.MatMul.weight":
            q, k, v = _split_rows(tensor.T, kv_rows)
            state.update(
                {prefix + f"self_attn.{p}_proj.weight": t for p, t in zip("qkv", (q, k, v), strict=True)}
            )
        elif rest.endswith(".MatMul.weight"):
            module = re.sub(r"^attn\.", "self_attn.", rest.removesuffix(".MatMul.weight"))
            module = re.sub(r"^linear_attn\.(qkv|z|a|b)_proj", r"linear_attn.in_proj_\1", module)
            state[prefix + module + ".weight"] = tensor.T.contiguous()
        elif rest == "linear_attn.neg_exp_A":
            state[prefix + "linear_attn.A_log"] = torch.log(-tensor)
        elif rest == "linear_attn.conv1d.bias":
            if torch.count_nonzero(tensor):
                raise ValueError(f"{name} is not zero: this is not an export of a demo model (no conv bias)")
        elif rest.startswith("attn.") and rest.endswith("norm.layernorm.weight"):
            state[prefix + "self_attn." + rest.split(".")[1] + ".weight"] = tensor - 1.0
        elif rest.split(".")[0] in _OFFSET_NORMS:
            state[prefix + rest] = tensor - 1.0
        else:  # linear_attn.conv1d.weight, linear_attn.dt_bias, linear_attn.norm.weight
            state[prefix + rest] = tensor
    return state


def _split_rows(qkv: Any, kv_rows: int) -> tuple[Any, Any, Any]:
    """q_proj (query and gate per head), k_proj and v_proj rows of the builder's fused ``[q|k|v]``."""
    q, k, v = qkv.split([qkv.shape[0] - 2 * kv_rows, kv_rows, kv_rows])
    return q.contiguous(), k.contiguous(), v.contiguous()


def prune_mlp(state: dict[str, Any], width: int, hidden_of: Any) -> dict[str, Any]:
    """Keep, in every layer, the ``width`` MLP channels with the largest mean output on training text.

    ``hidden_of(layer) -> [n, hidden]`` gives the inputs of that layer's MLP (after its norm) on a few
    training windows."""
    import torch

    pruned = dict(state)
    layers = sorted({int(k.split(".")[2]) for k in state if k.startswith("model.layers.")})
    for layer in layers:
        p = f"model.layers.{layer}.mlp."
        gate, up, down = (
            state[p + "gate_proj.weight"],
            state[p + "up_proj.weight"],
            state[p + "down_proj.weight"],
        )
        if gate.shape[0] <= width:
            continue
        x = hidden_of(layer)
        act = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)).abs().mean(0)
        keep = torch.argsort(act * down.norm(dim=0), descending=True)[:width].sort().values
        pruned[p + "gate_proj.weight"] = gate[keep].contiguous()
        pruned[p + "up_proj.weight"] = up[keep].contiguous()
        pruned[p + "down_proj.weight"] = down[:, keep].contiguous()
    return pruned


def init_from_export(
    model: Any, config: DemoConfig, export_dir: Path, train_ids: np.ndarray
) -> dict[str, float]:
    """Load ``export_dir``'s weights into ``model.lm`` (a :class:`~tools.demo_model.model.DemoModel`),
    pruning its MLPs to ``config.intermediate`` channels; the MTP head keeps its fresh initialization.
    Returns how far the loaded model's logits are from the export's (before pruning), and how many
    channels each layer lost."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    from tools.demo_model.data import batch_at
    from tools.demo_model.measure import prefill_logits_fn

    state = state_dict_from_export(export_dir)
    full = Qwen3_5ForCausalLM(
        _with_width(config, state["model.layers.0.mlp.gate_proj.weight"].shape[0])
    ).eval()
    missing, unexpected = full.load_state_dict(state, strict=False)
    if unexpected or set(missing) != {"lm_head.weight"}:  # lm_head is tied to embed_tokens
        raise RuntimeError(
            f"{export_dir} does not map onto the demo model: missing {missing}, unexpected {unexpected}"
        )
    probe = batch_at(train_ids, 0, 2, 128, config.seed)[:, :-1]
    with torch.no_grad():
        ours = full(input_ids=torch.from_numpy(probe)).logits.numpy()
    diff = float(np.abs(ours - prefill_logits_fn(export_dir)(probe)).max())
    if diff > 1e-2:
        raise RuntimeError(
            f"the model rebuilt from {export_dir} differs from the export by {diff:.2e} in logits"
        )
    width = state["model.layers.0.mlp.gate_proj.weight"].shape[0]
    if width < config.intermediate:
        raise ValueError(
            f"{export_dir} has an MLP of {width} channels, narrower than intermediate={config.intermediate}"
            f": start from it with intermediate <= {width}"
        )
    if width > config.intermediate:
        state = _pruned(full, state, config, train_ids)
    missing, unexpected = model.lm.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"loading {export_dir}: missing {missing}, unexpected {unexpected}")
    return {"export_logit_diff": diff, "pruned_channels": width - config.intermediate}


def _pruned(full: Any, state: dict[str, Any], config: DemoConfig, train_ids: np.ndarray) -> dict[str, Any]:
    """``state`` with its MLPs pruned to ``config.intermediate`` channels, ranked on a few training
    windows run through ``full`` (the model ``state`` loads into)."""
    import torch

    from tools.demo_model.data import batch_at

    captured: dict[int, Any] = {}
    hooks = [
        layer.mlp.register_forward_hook(
            lambda mod, args, out, i=i: captured.__setitem__(i, args[0].flatten(0, 1))
        )
        for i, layer in enumerate(full.model.layers)
    ]
    calib = np.concatenate(
        [batch_at(train_ids, CALIBRATION_STEP + i, 4, config.seq_len, config.seed) for i in range(2)]
    )
    with torch.no_grad():
        full(input_ids=torch.from_numpy(calib[:, :-1]))
    for hook in hooks:
        hook.remove()
    return prune_mlp(state, config.intermediate, lambda i: captured[i])


def _with_width(config: DemoConfig, intermediate: int) -> Any:
    import dataclasses

    return dataclasses.replace(config, intermediate=intermediate).text_config()
