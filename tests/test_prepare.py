"""``onnxgen.prepare.prepare``: a model's graph passes, decode plan, MTP head and verify strategy decided
without an onnxruntime session, from the config a load is given; a session built from the result runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnxgen.config import EngineConfig
from onnxgen.model import ModelPackage
from onnxgen.prepare import prepare
from onnxgen.testing import build_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prepare")
    return {f: build_model(root / f, f, precision="int4") for f in ("genai-dense", "hybrid-genai")}


def no_session(monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("prepare made an onnxruntime session")

    monkeypatch.setattr(onnxruntime, "InferenceSession", refuse)


def test_prepare_decides_from_the_graph_alone_and_follows_the_config(
    dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    no_session(monkeypatch)
    dense, hybrid = (ModelPackage.open(dirs[f]) for f in ("genai-dense", "hybrid-genai"))
    d = prepare(dense, EngineConfig(threads=2))
    assert d.decode.choice.plan == "main" and d.decode.graph is None  # no graph kept once prepared
    assert d.graph.logits_to_keep and d.graph.fusions.merged_matmuls > 0
    assert d.verify.strategy is None and "no recurrent state" in d.verify.reason
    assert d.mtp.path is None and "mtp.onnx" in d.mtp.missing
    assert prepare(dense, EngineConfig(threads=2)).graph.cache == "hit"
    unfused = prepare(dense, EngineConfig(threads=2, fuse=False)).graph
    assert not unfused.fusions.rewritten and unfused.graph_path != d.graph.graph_path
    h = prepare(hybrid, EngineConfig(fast_ops=True))
    assert h.verify.strategy == "auto" and h.graph.fast_ops.rewritten and h.graph.inplace_states
    assert not prepare(hybrid, EngineConfig(fast_ops=False)).graph.fast_ops.rewritten


def test_a_session_made_from_the_prepared_model_runs_the_prepared_graph(dirs: dict[str, Path]) -> None:
    prepared = prepare(ModelPackage.open(dirs["hybrid-genai"]), EngineConfig(threads=2, fast_ops=False))
    session = prepared.open_session()
    assert session.prepared is prepared.graph and prepared.decode.plan.name == "main"
    assert session.fusions.merged_matmuls == prepared.graph.fusions.merged_matmuls > 0
    state = session.new_state(8)
    logits = session.forward(state, np.array([[5, 9, 2]]), 1)
    assert logits.shape == (1, 1, session.vocab_size) and np.isfinite(logits).all()
