"""The speculative-decoding spec strings ``prompt-lookup``, ``draft:PATH``, ``mtp`` and ``mtp-always``
(the CLI's ``--speculative`` and ``onnxgen serve``'s server-wide default), checked, and the library object
each stands for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxgen.generation.speculative import MTP, DraftModel, PromptLookup, Speculative

PROMPT_LOOKUP = "prompt-lookup"
DRAFT_PREFIX = "draft:"
MTP_AUTO, MTP_ALWAYS = "mtp", "mtp-always"
OFF = "off"  # no speculation (what leaving the flag out gives)
DEFAULT_DRAFT_TOKENS = 4
DEFAULT_MTP_TOKENS = 2
MODES_HINT = (
    f"give {PROMPT_LOOKUP}, {DRAFT_PREFIX}PATH (a draft model directory with the target's tokenizer), "
    f"{MTP_AUTO} or {MTP_ALWAYS} (the model's MTP head), or {OFF}"
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
    if value is None or value == OFF:
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
