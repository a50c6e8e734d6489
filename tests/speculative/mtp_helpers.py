"""Tiny models with an MTP head beside them, for the MTP speculation tests.

A random head is accepted almost never, so the models that need acceptance pair a bigram-like target (every
layer's contribution to the residual stream scaled down, :func:`onnxgen.testing.mtp.bigram_like`: the next
token depends mostly on the current one, and still on the context and the recurrent states) with a head
built to predict ``argmax lm_head(final_norm(embed(token)))`` (:func:`onnxgen.testing.mtp.copying_mtp_weights`):
about half its drafts are accepted, so verifies accept every prefix length from none to all.
"""

from __future__ import annotations

from pathlib import Path

import onnxgen
from onnxgen.export.mtp import write_mtp_head
from onnxgen.llm import LLM
from onnxgen.testing import TinySpec, build_model, make_weights
from onnxgen.testing.mtp import bigram_like, copying_mtp_weights, geometry_of, make_mtp_weights

STRENGTH = 0.2  # how much of each layer's output the bigram-like target keeps


def spec_of(family: str, **kw: object) -> TinySpec:
    return TinySpec.hybrid(**kw) if family.startswith("hybrid") else TinySpec(**kw)  # type: ignore[arg-type]


def build_mtp_model(
    root: Path, family: str, precision: str = "fp32", head: str = "copying", spec: TinySpec | None = None
) -> Path:
    """A bigram-like tiny decoder of ``family`` with a ``copying`` or ``random`` head beside it."""
    spec = spec or spec_of(family)
    weights = bigram_like(make_weights(spec), spec, STRENGTH)
    d = build_model(
        root / f"{family}-{precision}-{head}-{spec.vocab_size}",
        family,
        spec,
        precision=precision,
        weights=weights,
    )
    g = geometry_of(spec)
    head_weights = (
        copying_mtp_weights(spec, weights["final_norm"]) if head == "copying" else make_mtp_weights(g)
    )
    write_mtp_head(d, g, head_weights)
    return d


class MTPZoo:
    """One-thread LLMs with heads, built on first request and kept for the session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._llms: dict[tuple[str, str, str, TinySpec | None], LLM] = {}

    def llm(
        self, family: str, precision: str = "fp32", head: str = "copying", spec: TinySpec | None = None
    ) -> LLM:
        key = (family, precision, head, spec)
        if key not in self._llms:
            self._llms[key] = onnxgen.load(
                build_mtp_model(self.root, family, precision, head, spec), threads=1
            )
        return self._llms[key]
