"""Speculative decoding: what to draft with, and the loop that verifies and commits drafts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _check_k(num_draft_tokens: int) -> None:
    if not isinstance(num_draft_tokens, int) or isinstance(num_draft_tokens, bool) or num_draft_tokens < 1:
        raise ValueError(
            f"num_draft_tokens must be an integer >= 1 (got {num_draft_tokens!r}); 4 is a good start"
        )


@dataclass(frozen=True)
class PromptLookup:
    """Draft by n-gram lookup in the prompt and generated text (no extra model).

    ``adaptive``: each verify carries up to ``num_draft_tokens`` drafts at first; the length doubles after
    a verify that accepted all its drafts (up to 3x ``num_draft_tokens``), drops by one after a rejection,
    and a cost model of the measured verify times caps it (:mod:`.budget`). False: always
    ``num_draft_tokens``.
    """

    num_draft_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    adaptive: bool = True

    def __post_init__(self) -> None:
        _check_k(self.num_draft_tokens)
        if not (isinstance(self.min_ngram, int) and isinstance(self.max_ngram, int)) or not (
            1 <= self.min_ngram <= self.max_ngram
        ):
            raise ValueError(
                f"PromptLookup needs 1 <= min_ngram <= max_ngram (got min_ngram={self.min_ngram!r}, "
                f"max_ngram={self.max_ngram!r})"
            )


@dataclass(frozen=True)
class DraftModel:
    """Draft with a smaller model of the same tokenizer: an ``onnxgen.LLM`` or a model directory.
    ``adaptive`` as for :class:`PromptLookup`."""

    model: Any
    num_draft_tokens: int = 4
    adaptive: bool = True

    def __post_init__(self) -> None:
        _check_k(self.num_draft_tokens)


@dataclass(frozen=True)
class MTP:
    """Draft with the model's own multi-token-prediction head (``mtp.onnx`` beside the model, e.g. written by
    ``onnxgen export-mtp``): the head reads the target's final hidden state and drafts ``num_draft_tokens``
    tokens by chaining itself.

    ``auto``: measure the verify cost, the head's cost and the acceptance during the request, and go back
    to plain decoding for the rest of it once they predict no gain (:mod:`.budget`); False: always draft.
    ``adaptive`` as for :class:`PromptLookup`.
    """

    num_draft_tokens: int = 2
    auto: bool = True
    adaptive: bool = True

    def __post_init__(self) -> None:
        _check_k(self.num_draft_tokens)


Speculative = PromptLookup | DraftModel | MTP

__all__ = ["MTP", "DraftModel", "PromptLookup", "Speculative"]
