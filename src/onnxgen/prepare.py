"""Preparing a model, apart from running it: :func:`prepare` turns a model package and an
:class:`~onnxgen.config.EngineConfig` into a :class:`PreparedModel`.

Preparing reads the graph once (weights not loaded) and decides everything that can be decided from it:

- the decode plan single-token steps run on (:mod:`onnxgen.runtime.decode_routing`; for the inline plan,
  the optimized copy both sessions load, made once and kept in the cache);
- whether an MTP head beside the model can read the decoder's final hidden state;
- the graph the session runs: the export after the graph passes (:mod:`onnxgen.graph`), read from or
  written to the cache of prepared graphs (:mod:`onnxgen.runtime.graph_cache`), with each pass's report;
- the verify plan's strategy for speculative decoding (its graph is made when speculation first needs it).

What needs a session is left to it: the inline decode plan's first-step check against the Scan plan
(:meth:`~onnxgen.runtime.decode_routing.DecodePlan.settle`), and the verify plan's own graph. ``onnxgen
inspect`` reports a :class:`PreparedModel` and makes no onnxruntime session unless that check must run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx

from onnxgen.config import EngineConfig
from onnxgen.errors import OnnxgenError
from onnxgen.graph.hidden_state import expose_hidden_state
from onnxgen.model.mtp import find_mtp_head
from onnxgen.model.package import ModelPackage
from onnxgen.runtime.decode_routing import PreparedPlan, prepare_decode_plan
from onnxgen.runtime.graph_cache import SessionGraph, session_graph
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state_commit import verify_strategy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MTPChoice:
    """The MTP head beside the model that ``--speculative mtp`` drafts with (None: none usable), and why
    not."""

    path: Path | None
    missing: str


@dataclass(frozen=True)
class VerifyChoice:
    """The verify plan's strategy (None: speculative verifies commit recurrent states by replay) and why."""

    strategy: str | None
    reason: str


@dataclass
class PreparedModel:
    """A model ready for a session: the decode plan, the prepared graph and the plans' decisions."""

    package: ModelPackage
    config: EngineConfig
    decode: PreparedPlan  # the decode plan (its inline check runs on the session) and the model it loads
    graph: SessionGraph  # what the main session runs, and what each graph pass did
    mtp: MTPChoice
    verify: VerifyChoice

    def open_session(self, before_initialize: Callable[[], None] | None = None) -> DecoderSession:
        """The onnxruntime session on the prepared graph with the config's settings, the decode plan attached
        (the inline plan's sibling is made and checked at the first single-token step);
        ``before_initialize`` as :class:`~onnxgen.runtime.session.DecoderSession` takes it."""
        config = self.config
        session = DecoderSession(
            self.graph,
            threads=config.threads,
            providers=config.providers,
            huge_pages=config.huge_pages,
            verify=self.verify.strategy or False,
            verify_now=config.speculative,
            spinning=config.spinning,
            before_initialize=before_initialize,
        )
        self.decode.plan.attach(session)
        return session


def find_mtp(package: ModelPackage, graph: onnx.ModelProto) -> MTPChoice:
    """The MTP head beside the model, where the decoder's final hidden state can be output for it (from
    ``graph``, what the session loads); otherwise None and why (plain decoding is not held up by a broken
    head)."""
    missing = (
        f"MTP speculation needs the model's MTP head: {package.root} has no mtp.onnx; write it with "
        "`onnxgen export-mtp CHECKPOINT_DIR MODEL_DIR` from the checkpoint this model was exported from"
    )
    try:
        path = find_mtp_head(package)
    except OnnxgenError as e:
        log.warning("MTP speculation is unavailable: %s", e)
        return MTPChoice(None, str(e))
    if path is None:
        return MTPChoice(None, missing)
    exposed = expose_hidden_state(graph, package.io.logits)
    if exposed.output is None:
        why = f"{path} cannot be used: the decoder's final hidden state cannot be output ({exposed.report})"
        log.warning("%s", why)
        return MTPChoice(None, why)
    return MTPChoice(path, missing)


def prepare(package: ModelPackage, config: EngineConfig | None = None) -> PreparedModel:
    """Prepare ``package`` for a session with ``config`` (default: ``EngineConfig()``): the decode plan, the
    MTP head, the graph after the passes (from the cache where it was prepared before) and the verify
    strategy. No onnxruntime session is made, except once per model and onnxruntime version to write the
    inline decode plan's optimized copy; the graph read here is dropped once the prepared one is made."""
    config = config if config is not None else EngineConfig()
    decode = prepare_decode_plan(package, config.decode_plan, providers=config.providers)
    assert decode.graph is not None  # the graph of the model the main session loads, until it is prepared
    mtp = find_mtp(package, decode.graph)
    graph = session_graph(
        decode.model_path,
        package.io,
        providers=config.providers,
        graph=decode.graph,
        fast_ops=config.fast_ops,
        fuse=config.fuse,
        hidden_state=mtp.path is not None,
        threads=config.threads,
    )
    decode.graph = None  # the prepared graph is read from disk when a pass needs it again
    verify = VerifyChoice(*verify_strategy(True, package.io))
    return PreparedModel(package, config, decode, graph, mtp, verify)


__all__ = ["MTPChoice", "PreparedModel", "VerifyChoice", "find_mtp", "prepare"]
