"""What every graph rewrite of :mod:`onnxgen.graph` returns: :class:`PassResult`.

A pass is a function ``pass(model, ...) -> PassResult``: ``model`` is an ``onnx.ModelProto`` (weights need
not be loaded) that the pass leaves untouched; the result holds the rewritten model (``model`` itself when
nothing changed), whether it changed, and the pass's report: what it did and why it left the rest. This is
onnx-ir's ``PassResult`` (model, modified) on ONNX protos, with the report beside it. Analyses (a graph's
facts, e.g. :func:`onnxgen.graph.mask_lengths.mask_feeds_lengths_only`) return facts, not models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import onnx

Report = TypeVar("Report")


@dataclass(frozen=True)
class PassResult(Generic[Report]):
    """A pass's rewritten ``model`` (the input itself when not ``modified``) and its ``report``."""

    model: onnx.ModelProto
    modified: bool
    report: Report


__all__ = ["PassResult"]
