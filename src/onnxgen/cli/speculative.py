"""``--speculative prompt-lookup|draft:PATH|mtp|mtp-always`` and ``--draft-tokens K``, shared by generate,
chat and bench.

``prompt-lookup`` drafts by n-gram lookup in the prompt and the text generated so far
(:class:`~onnxgen.generation.speculative.PromptLookup`); ``draft:PATH`` drafts with a smaller model of the
same tokenizer (:class:`~onnxgen.generation.speculative.DraftModel`); ``mtp`` with the model's own
multi-token-prediction head (:class:`~onnxgen.generation.speculative.MTP`), turned off for the rest of a
request once the measured costs and acceptance predict no gain, and ``mtp-always`` drafts with it
throughout. Greedy output is the same as without speculation; sampled output has the same distribution.
"""

from __future__ import annotations

import argparse
from typing import Any

from onnxgen.generation.speculative import Speculative
from onnxgen.generation.speculative.spec import (
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_MTP_TOKENS,
    DRAFT_PREFIX,
    MTP_ALWAYS,
    MTP_AUTO,
    PROMPT_LOOKUP,
    parse_speculative,
)


def add_speculative_flags(p: argparse.ArgumentParser, scope: str = "") -> None:
    """``--speculative`` and ``--draft-tokens``; ``scope`` says what the setting applies to."""
    g = p.add_argument_group("speculative decoding" + (f": {scope}" if scope else ""))
    g.add_argument(
        "--speculative",
        metavar="MODE",
        help=f"{PROMPT_LOOKUP} (n-gram lookup in the context), {DRAFT_PREFIX}PATH (a smaller draft model "
        f"with the same tokenizer), {MTP_AUTO} (the model's MTP head, mtp.onnx, while it pays) or "
        f"{MTP_ALWAYS}; greedy output is unchanged",
    )
    g.add_argument(
        "--draft-tokens",
        type=int,
        metavar="K",
        help=f"tokens drafted for the first verify (default {DEFAULT_DRAFT_TOKENS}, {DEFAULT_MTP_TOKENS} for MTP); "
        "the length then doubles after a fully accepted draft and drops by one after a miss, between 1 "
        "and 3K",
    )


def speculative_from_args(args: argparse.Namespace) -> Speculative | None:
    """The library's speculative setting for the parsed flags (None: plain decoding)."""
    spec = parse_speculative(getattr(args, "speculative", None), getattr(args, "draft_tokens", None))
    return spec.build() if spec is not None else None


def format_speculative_stats(stats: dict[str, Any]) -> str:
    """`` | drafts A/P accepted | F target forwards (T tokens/forward)`` when the stats are speculative."""
    if "proposed_draft_tokens" not in stats:
        return ""
    forwards = int(stats.get("target_forward_passes", 0))
    generated = int(stats.get("generated_tokens", 0))
    per_forward = generated / forwards if forwards else 0.0
    text = (
        f" | drafts {stats['accepted_draft_tokens']}/{stats['proposed_draft_tokens']} accepted"
        f" | {forwards} target forwards ({per_forward:.2f} tokens/forward)"
    )
    replays = int(stats.get("state_replays", 0))
    text += f", {replays} state replays" if replays else ""
    if "speculation" in stats:  # auto: whether the drafts paid
        gain = stats.get("predicted_speedup")
        text += f" | speculation {stats['speculation']}" + (f" (predicted {gain:.2f}x)" if gain else "")
    return text
