"""The trained module: the Qwen3.5 text model and its MTP head, with the joint loss.

The loss is the Qwen3.5 / DeepSeek-V3 multi-token-prediction recipe: the next-token cross-entropy of
the model, plus ``mtp_weight`` times the cross-entropy of the head predicting token ``t+2`` from the
model's final hidden state at ``t`` and token ``t+1``. The head shares the embedding and the lm_head, and
its gradient reaches the whole model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tools.demo_model.config import DemoConfig
from tools.demo_model.mtp import MTPHead


class DemoModel(nn.Module):
    """``lm``: a transformers ``Qwen3_5ForCausalLM``; ``mtp``: its :class:`MTPHead` (None without one)."""

    def __init__(self, config: DemoConfig) -> None:
        super().__init__()
        from transformers import Qwen3_5ForCausalLM

        torch.manual_seed(config.seed)
        text_config = config.text_config()
        self.lm = Qwen3_5ForCausalLM(text_config).float()
        if self.lm.lm_head.weight is not self.lm.model.embed_tokens.weight:
            raise RuntimeError("expected tied input/output embeddings (tie_word_embeddings=True)")
        self.mtp = MTPHead(text_config).float() if config.mtp_weight > 0 else None
        self.head_only = config.head_only
        if self.head_only:
            if self.mtp is None:
                raise ValueError("head_only trains the MTP head alone: it needs mtp_weight > 0")
            self.lm.requires_grad_(False)

    def forward(self, windows: Any) -> tuple[Any, Any]:
        """Per-token losses (nats) of ``windows [batch, seq + 1]``: the model's over ``windows[:, 1:]``
        ``[batch, seq]``, and the head's over ``windows[:, 2:]`` ``[batch, seq - 1]`` (None without one)."""
        ids = windows[:, :-1]
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.head_only):
            hidden = self.lm.model(input_ids=ids).last_hidden_state
            main = _cross_entropy(self.lm.lm_head(hidden), windows[:, 1:])
        if self.mtp is None:
            return main, None
        logits = head_logits(self.lm, self.mtp, hidden[:, :-1], windows[:, 1:-1])
        return main, _cross_entropy(logits, windows[:, 2:])


def head_logits(lm: Any, head: MTPHead, hidden: Any, next_ids: Any) -> Any:
    """The head's logits for token ``t+2`` at every ``t`` of ``hidden [batch, n, hidden]`` (the model's
    final hidden states at positions ``0..n-1``) and ``next_ids [batch, n]`` (tokens ``1..n``)."""
    text_model = lm.model if hasattr(lm.model, "embed_tokens") else lm.model.language_model
    positions = torch.arange(hidden.shape[1]).view(1, 1, -1).expand(3, hidden.shape[0], -1)
    rotary = text_model.rotary_emb(hidden, positions)
    return lm.lm_head(head(text_model.embed_tokens(next_ids), hidden, rotary))


def _cross_entropy(logits: Any, targets: Any) -> Any:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)


def head_agreement(lm: Any, head: MTPHead, windows: Any) -> tuple[int, int, int]:
    """Teacher-forced on ``windows [batch, seq + 1]``: (positions, positions where the head's argmax equals
    the model's own greedy token after next, positions where it equals the text's token after next).

    At position ``t`` the head reads the model's hidden state at ``t`` and the text's token ``t+1``; the
    model's greedy token after next is its argmax at ``t+1`` over the same text. The first is the
    acceptance of a one-token MTP draft under greedy decoding."""
    with torch.no_grad():
        ids = windows[:, :-1]
        text_model = lm.model if hasattr(lm.model, "embed_tokens") else lm.model.language_model
        hidden = text_model(input_ids=ids).last_hidden_state
        greedy = lm.lm_head(hidden).argmax(-1)  # [batch, seq]: the model's token t+1 at each t
        drafted = head_logits(lm, head, hidden[:, :-1], ids[:, 1:]).argmax(-1)
        agree = int((drafted == greedy[:, 1:]).sum())
        correct = int((drafted == windows[:, 2:]).sum())
    return drafted.numel(), agree, correct
