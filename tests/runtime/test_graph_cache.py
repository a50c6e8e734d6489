"""Prepared session graphs (onnxgen.runtime.graph_cache): made once, reused without pass work, the same
logits as the passes applied in memory, stale entries never used, and nothing of the graph kept in Python."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxgen
from onnxgen.errors import ModelPackageError
from onnxgen.graph.decode_fusions import fuse_for_decode
from onnxgen.model import ModelPackage
from onnxgen.runtime import graph_cache
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state_commit import CapturePlan
from onnxgen.testing import build_model
from onnxgen.testing.loop import run_teacher_forced

PROMPT = [5, 9, 2, 7, 1, 3]
STEPS = 8


@pytest.fixture(scope="module")
def int4_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("graph-cache")
    return {f: build_model(root / f, f, precision="int4") for f in ("genai-dense", "hybrid-genai")}


CAPACITY = len(PROMPT) + STEPS + 1


def decode(session: DecoderSession, steps: int = STEPS) -> np.ndarray:
    """Prefill PROMPT (logits of every position), then greedy single-token steps; every row of logits."""
    state = session.new_state(CAPACITY)
    rows = list(session.forward(state, np.array([PROMPT]))[0])
    for _ in range(steps):
        rows.append(session.step(state, int(rows[-1].argmax())).copy())
    return np.stack(rows)


def open_session(model_dir: Path, verify: bool = True, **passes: bool) -> DecoderSession:
    """A one-thread session on the graph prepared for two threads: every rewrite, sibling merges included."""
    package = ModelPackage.open(model_dir)
    return DecoderSession(
        graph_cache.session_graph(package.model_path, package.io, threads=2, **passes),
        threads=1,
        verify=verify,
    )


def in_memory_logits(model_dir: Path, tokens: list[int], tmp_path: Path, capacity: int) -> np.ndarray:
    """The fusions applied in memory with every weight loaded into the graph (what sessions were built
    from before graphs were prepared on disk), run by a plain onnxruntime loop over the same tokens."""
    graph = onnx.load(str(model_dir / "model.onnx"))  # weights loaded
    done = fuse_for_decode(graph, None)
    graph, fusions = done.model, done.report
    assert fusions.merged_matmuls > 0
    onnx.save(graph, str(tmp_path / "inline.onnx"))
    return run_teacher_forced(tmp_path / "inline.onnx", [PROMPT], [tokens], kv_capacity=capacity)[0]


def test_a_second_load_reads_the_prepared_graph_and_runs_no_pass(
    int4_dirs: dict[str, Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = open_session(int4_dirs["hybrid-genai"])
    assert first.prepared.cache == "miss" and first.fusions.merged_matmuls > 0
    folder = first.prepared.graph_path.parent  # type: ignore[union-attr]
    assert (folder / graph_cache.WEIGHTS_FILE).stat().st_size > 0

    def no_pass(*args: object, **kwargs: object) -> None:
        raise AssertionError("a pass ran on a load that the cache should serve")

    for name in ("keep_last_logits", "apply_fast_ops", "fuse_for_decode", "inplace_states"):
        monkeypatch.setattr(graph_cache, name, no_pass)
    monkeypatch.setattr(graph_cache, "mask_feeds_lengths_only", no_pass)
    second = open_session(int4_dirs["hybrid-genai"])
    assert second.prepared.cache == "hit"
    assert second.prepared.to_json() == first.prepared.to_json()
    assert (second.fusions, second.inplace_states, second.logits_to_keep) == (
        first.fusions,
        first.inplace_states,
        first.logits_to_keep,
    )
    np.testing.assert_array_equal(decode(second), decode(first))


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai"])
def test_the_prepared_graph_gives_the_logits_of_the_passes_applied_in_memory(
    int4_dirs: dict[str, Path], cache_dir: Path, tmp_path: Path, family: str
) -> None:
    """Weights by reference (the export's file, the cache's merged weights) compute the same bits as the
    rewritten graph with every weight inline, on a cache miss and on a hit."""
    runs = []
    for expected in ("miss", "hit"):
        session = open_session(int4_dirs[family], fast_ops=False)
        assert session.prepared.cache == expected and session.prepared.graph_path is not None
        runs.append(decode(session))
    np.testing.assert_array_equal(runs[1], runs[0])
    tokens = [int(row.argmax()) for row in runs[0][len(PROMPT) - 1 : -1]]
    np.testing.assert_array_equal(runs[0], in_memory_logits(int4_dirs[family], tokens, tmp_path, CAPACITY))


def test_a_changed_model_is_prepared_anew(tmp_path: Path, cache_dir: Path) -> None:
    model_dir = build_model(tmp_path / "m", "genai-dense", precision="int4")
    old = open_session(model_dir)
    old_logits = decode(old)
    data = model_dir / "model.onnx.data"
    weights = np.fromfile(data, np.uint8)
    weights[weights.size // 2 :] = np.random.default_rng(1).integers(0, 256, weights.size - weights.size // 2)
    weights.tofile(data)  # same size, new contents and time: the weights of the merged projections change
    new = open_session(model_dir)
    assert new.prepared.cache == "miss"
    assert new.prepared.graph_path != old.prepared.graph_path
    new_logits = decode(new)
    assert not np.array_equal(new_logits, old_logits)
    fresh = open_session(model_dir, fuse=False)  # no merged weights, so nothing could be stale
    np.testing.assert_array_equal(new_logits, decode(fresh))


def test_no_model_proto_outlives_a_load_or_the_first_verify(
    int4_dirs: dict[str, Path], cache_dir: Path
) -> None:
    def live_protos() -> int:
        gc.collect()
        return sum(type(o) is onnx.ModelProto for o in gc.get_objects())

    before = live_protos()
    llm = onnxgen.load(int4_dirs["hybrid-genai"], threads=1)
    assert live_protos() == before
    assert isinstance(llm.session.verify_plan, CapturePlan)  # the verify graph is made and loaded
    assert live_protos() == before
    assert llm.package.graph.graph.node  # read again on demand


def test_the_verify_plan_session_is_made_after_the_plain_one_is_gone(
    int4_dirs: dict[str, Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One session's weights at a time: when the plan's graph loads, nothing holds the plain session
    (the decode state's bindings and lanes held it); decoding goes on bit for bit."""
    session = open_session(int4_dirs["hybrid-genai"])
    plain = open_session(int4_dirs["hybrid-genai"], verify=False)
    state, ref = session.new_state(32), plain.new_state(32)
    for i in range(4):  # prefill and lane steps: bindings and lanes on the plain session
        ids = np.array([PROMPT]) if i == 0 else np.array([[7 + i]])
        session.forward(state, ids, 1)
        plain.forward(ref, ids, 1)
    assert state.bindings.binders
    old = weakref.ref(session.session._sess)
    seen: list[bool] = []
    load = session._load

    def checked_load(source: str | bytes) -> ort.InferenceSession:
        gc.collect()
        seen.append(old() is None)
        return load(source)

    monkeypatch.setattr(session, "_load", checked_load)
    assert isinstance(session.verify_plan, CapturePlan)
    assert seen == [True]
    for t in (11, 12, 13):
        np.testing.assert_array_equal(session.step(state, t), plain.step(ref, t))


def test_an_external_location_outside_the_model_folder_is_refused(tmp_path: Path, cache_dir: Path) -> None:
    model_dir = build_model(tmp_path / "m", "genai-dense", precision="int4")
    graph = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    (tmp_path / "outside.data").write_bytes((model_dir / "model.onnx.data").read_bytes())
    for t in graph.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../outside.data"
    onnx.save(graph, str(model_dir / "model.onnx"))
    with pytest.raises(ModelPackageError, match=r"'\.\./outside\.data' is not a relative path inside"):
        open_session(model_dir)


def test_a_model_keeps_its_most_recently_used_prepared_graphs_only(
    int4_dirs: dict[str, Path], cache_dir: Path
) -> None:
    package = ModelPackage.open(int4_dirs["hybrid-genai"])
    settings = [
        graph_cache.PassSettings(fuse=fuse, fast_ops=fast, last_logits=last)
        for fuse in (True, False)
        for fast in (True, False)
        for last in (True, False)
    ][: graph_cache.KEEP_PER_MODEL + 2]
    folders = []
    for s in settings:
        prepared = graph_cache.prepare_session_graph(package.model_path, package.io, s)
        folders.append(
            cache_dir / "graphs" / graph_cache.cache_key(package.model_path, package.graph, package.io, s)
        )
        assert prepared.cache == "miss"
    kept = sorted(p.name for p in (cache_dir / "graphs").iterdir() if (p / graph_cache.FACTS_FILE).is_file())
    assert kept == sorted(f.name for f in folders[-graph_cache.KEEP_PER_MODEL :])


def test_the_verify_plan_is_made_when_the_prepared_graph_was_pruned_meanwhile(
    int4_dirs: dict[str, Path], cache_dir: Path
) -> None:
    import shutil

    session = open_session(int4_dirs["hybrid-genai"])
    plain = open_session(int4_dirs["hybrid-genai"], verify=False)
    state, ref = session.new_state(32), plain.new_state(32)
    np.testing.assert_array_equal(
        session.forward(state, np.array([PROMPT]), 1), plain.forward(ref, np.array([PROMPT]), 1)
    )
    shutil.rmtree(session.prepared.graph_path.parent)  # type: ignore[union-attr]
    assert isinstance(session.verify_plan, CapturePlan)
    for t in (11, 12, 13):
        np.testing.assert_array_equal(session.step(state, t), plain.step(ref, t))


def test_a_cache_that_shares_no_folder_with_the_model_leaves_the_passes_out(
    int4_dirs: dict[str, Path],
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As on Windows with the model and the cache on two drives: the export runs as it is, one warning."""

    def no_common(paths: list[str]) -> str:
        raise ValueError("Paths don't have the same drive")

    monkeypatch.setattr(graph_cache.os.path, "commonpath", no_common)
    with caplog.at_level("WARNING", logger="onnxgen.runtime.graph_cache"):
        session = open_session(int4_dirs["hybrid-genai"], verify=False)
    assert "share no folder" in caplog.text
    assert session.prepared.graph_path is None and not session.fusions.rewritten
    assert not session.logits_to_keep and session.inplace_states  # the analyses still hold
    monkeypatch.undo()
    plain = open_session(
        int4_dirs["hybrid-genai"], fuse=False, verify=False, last_logits=False, fast_ops=False
    )
    np.testing.assert_array_equal(decode(session), decode(plain))


def test_every_setting_and_io_difference_that_changes_the_graph_changes_the_key(
    int4_dirs: dict[str, Path],
) -> None:
    """The hidden-state output (an MTP head's input), the other pass settings and the derived I/O (a KV
    layout read from genai_config, a static cache) each give their own prepared graph; notes do not."""
    import dataclasses

    from onnxgen.model.io import StaticCache

    package = ModelPackage.open(int4_dirs["genai-dense"])
    path, graph, io = package.model_path, package.graph, package.io
    base = graph_cache.PassSettings()
    keys = {
        graph_cache.cache_key(path, graph, io, s)
        for s in (
            base,
            dataclasses.replace(base, hidden_state=True),
            dataclasses.replace(base, last_logits=False),
            dataclasses.replace(base, fuse=False),
            dataclasses.replace(base, merge_matmuls=False),
            dataclasses.replace(base, fast_ops=False),
            dataclasses.replace(base, on_cpu=False),
        )
    }
    static = dataclasses.replace(io, static_cache=StaticCache("write_indices", None, 64))
    shared = dataclasses.replace(io, past_present_share_buffer=not io.past_present_share_buffer)
    keys |= {graph_cache.cache_key(path, graph, other, base) for other in (static, shared)}
    assert len(keys) == 9
    noted = dataclasses.replace(io, notes=(*io.notes, "a note"))
    assert graph_cache.cache_key(path, graph, noted, base) == graph_cache.cache_key(path, graph, io, base)


def test_with_the_cache_switched_off_nothing_is_kept_past_the_process_and_the_logits_are_the_same(
    int4_dirs: dict[str, Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = decode(open_session(int4_dirs["hybrid-genai"]))
    assert any(graph_cache.cached_graphs(cache_dir))
    before = sorted(p.name for p in graph_cache.cached_graphs(cache_dir))
    monkeypatch.setenv("ONNXGEN_CACHE", "off")
    session = open_session(int4_dirs["hybrid-genai"])
    folder = session.prepared.graph_path.parent  # type: ignore[union-attr]
    assert session.prepared.cache == "miss" and not folder.is_relative_to(cache_dir)
    assert folder.is_relative_to(graph_cache._process_folder())  # removed when the process exits
    assert sorted(p.name for p in graph_cache.cached_graphs(cache_dir)) == before
    np.testing.assert_array_equal(decode(session), kept)


DAMAGE = {
    "prepared.json {}": (graph_cache.FACTS_FILE, b"{}"),
    "prepared.json []": (graph_cache.FACTS_FILE, b"[]"),
    "prepared.json truncated": (graph_cache.FACTS_FILE, slice(0, 40)),
    "graph.onnx truncated": (graph_cache.GRAPH_FILE, slice(0, 1000)),
    "graph.onnx emptied": (graph_cache.GRAPH_FILE, b""),
    "graph.onnx deleted": (graph_cache.GRAPH_FILE, None),
    "weights.bin truncated": (graph_cache.WEIGHTS_FILE, slice(0, 4096)),
    "weights.bin deleted": (graph_cache.WEIGHTS_FILE, None),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_entry_is_prepared_again_and_gives_the_same_logits(
    int4_dirs: dict[str, Path], cache_dir: Path, damage: str
) -> None:
    first = open_session(int4_dirs["genai-dense"], verify=False)
    expected = decode(first)
    folder = first.prepared.graph_path.parent  # type: ignore[union-attr]
    name, change = DAMAGE[damage]
    path = folder / name
    if change is None:
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[change] if isinstance(change, slice) else change)
    again = open_session(int4_dirs["genai-dense"], verify=False)
    assert again.prepared.cache == "miss"
    np.testing.assert_array_equal(decode(again), expected)
    assert open_session(int4_dirs["genai-dense"], verify=False).prepared.cache == "hit"  # whole again


def test_build_folders_of_a_killed_start_are_removed_and_a_running_ones_are_kept(
    tmp_path: Path, cache_dir: Path
) -> None:
    model_dir = build_model(tmp_path / "m", "genai-dense")
    root = open_session(model_dir, verify=False).prepared.graph_path.parent.parent  # type: ignore[union-attr]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = root / f".build-{dead.pid}-killed"
    running = root / f".build-{os.getppid()}-busy"
    for folder in (left, running):
        folder.mkdir()
        (folder / graph_cache.GRAPH_FILE).write_bytes(b"half written")
    open_session(model_dir, verify=False, fuse=False)  # another entry: a preparation prunes
    assert not left.exists() and running.exists()
