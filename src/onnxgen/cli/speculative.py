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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxgen.generation.speculative import MTP, DraftModel, PromptLookup, Speculative

PROMPT_LOOKUP = "prompt-lookup"
DRAFT_PREFIX = "draft:"
MTP_AUTO, MTP_ALWAYS = "mtp", "mtp-always"
DEFAULT_DRAFT_TOKENS = 4
DEFAULT_MTP_TOKENS = 2
MODES_HINT = (
    f"give {PROMPT_LOOKUP}, {DRAFT_PREFIX}PATH (a draft model directory with the target's tokenizer), "
    f"{MTP_AUTO} or {MTP_ALWAYS} (the model's MTP head)"
)


@dataclass(frozen=True)
class SpeculativeSpec:
    """What ``--speculative`` / ``--draft-tokens`` asked for, checked; :meth:`build` makes the library object."""

    mode: str  # PROMPT_LOOKUP, "draft", MTP_AUTO or MTP_ALWAYS
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    draft_path: str | None = None

    @property
    def label(self) -> str:
        """The flag value this spec came from: ``prompt-lookup``, ``draft:PATH``, ``mtp`` or ``mtp-always``."""
        return f"{DRAFT_PREFIX}{self.draft_path}" if self.mode == "draft" else self.mode

    def build(self, draft: Any = None) -> Speculative:
        """The :class:`PromptLookup`, :class:`DraftModel` or :class:`MTP`; ``draft`` (an already loaded
        ``LLM``) replaces the draft path."""
        if self.mode == PROMPT_LOOKUP:
            return PromptLookup(num_draft_tokens=self.draft_tokens)
        if self.mode in (MTP_AUTO, MTP_ALWAYS):
            return MTP(num_draft_tokens=self.draft_tokens, auto=self.mode == MTP_AUTO)
        return DraftModel(draft if draft is not None else self.draft_path, num_draft_tokens=self.draft_tokens)


def parse_speculative(value: str | None, draft_tokens: int | None = None) -> SpeculativeSpec | None:
    """Check ``--speculative`` and ``--draft-tokens``; None when speculation is off. Raises ``ValueError``
    with a one-line message naming the flag and the fix."""
    if value is None:
        if draft_tokens is not None:
            raise ValueError(f"--draft-tokens {draft_tokens} needs --speculative; {MODES_HINT}")
        return None
    mtp = value in (MTP_AUTO, MTP_ALWAYS)
    k = (DEFAULT_MTP_TOKENS if mtp else DEFAULT_DRAFT_TOKENS) if draft_tokens is None else draft_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"--draft-tokens must be an integer >= 1 (got {k!r}); 4 is a good start")
    if value == PROMPT_LOOKUP or mtp:
        return SpeculativeSpec(value, k)
    if not value.startswith(DRAFT_PREFIX):
        raise ValueError(f"--speculative {value!r} is not a mode; {MODES_HINT}")
    path = value[len(DRAFT_PREFIX) :].strip()
    if not path:
        raise ValueError(
            f"--speculative {value!r} names no draft model; write {DRAFT_PREFIX}PATH, e.g. draft:./small"
        )
    if not Path(path).expanduser().exists():
        raise ValueError(
            f"--speculative {value!r}: the draft model {path} does not exist; "
            "give the directory of a model that shares the target's tokenizer"
        )
    return SpeculativeSpec("draft", k, str(Path(path).expanduser()))


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
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
