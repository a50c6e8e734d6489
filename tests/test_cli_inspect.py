"""``onnxgen inspect``: text and JSON summaries, and short errors (exit 2, no traceback) for bad models."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).parent / "model"))
from sigbuild import base_inputs, logits_port, qwen36_27b, sig_model, write_package

from onnxgen.cli import main
from onnxgen.generation.params import SamplingParams
from onnxgen.llm import default_model_dir, load
from onnxgen.runtime.graph_cache import SessionGraph
from onnxgen.testing import build_model
from onnxgen.validate import validate

CONFIGS = {
    "config.json": {"eos_token_id": 248044, "max_position_embeddings": 262144},
    "generation_config.json": {"eos_token_id": [248046, 248044], "bos_token_id": 1},
}


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_package(tmp_path_factory.mktemp("q36"), qwen36_27b(), CONFIGS)


def test_inspect_json_prints_one_object_with_roles_pairs_and_settings(
    hybrid_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(hybrid_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == "graph"
    assert (out["token_input"], out["attention_mask"], out["position_ids"], out["logits"]) == (
        "input_ids",
        "attention_mask",
        "position_ids",
        "logits",
    )
    assert len(out["kv_pairs"]) == 16 and len(out["state_pairs"]) == 96
    assert out["kv_pairs"][0]["shape"] == ["batch", 4, "past", 256]
    rec = next(s for s in out["state_pairs"] if s["kind"] == "recurrent")
    assert rec["shape"] == ["batch", 48, 128, 128] and rec["dtype"] == "float32"
    assert out["family"].startswith("hybrid")
    assert out["ops"]["ai.onnx"]["Cast"] > 0
    assert out["context_length"] == 262144
    assert out["eos_token_id"] == [248046, 248044]
    assert out["bos_token_id"] == 1
    assert any("eos_token_id" in n for n in out["notes"])


def test_inspect_text_names_family_roles_pairs_and_settings(
    hybrid_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(hybrid_dir)]) == 0
    out = capsys.readouterr().out
    assert "I/O from:       graph" in out
    assert "KV pairs:       16 layers (32 past tensors)" in out
    assert "layers 3..63 step 4: past_key_values.3.key -> present.3.key [batch, 4, past, 256] float32" in out
    assert "state pairs:    96" in out
    assert "recurrent at layers" in out and "[batch, 48, 128, 128]" in out
    assert "context length: 262144" in out
    assert "position ids:   position_ids (rank 3)" in out


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["inspect", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("onnxgen inspect: error: ")
    return err


def test_without_model_inspect_reads_onnxgen_model_then_the_bundled_model(
    hybrid_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Like generate, chat, bench and serve: MODEL, else $ONNXGEN_MODEL, else the bundled demo model."""
    monkeypatch.setenv("ONNXGEN_MODEL", str(hybrid_dir))
    assert main(["inspect", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["state_pairs"]) == 96
    monkeypatch.delenv("ONNXGEN_MODEL")
    assert main(["inspect", "--json"]) == 0
    bundled = json.loads(capsys.readouterr().out)
    assert Path(bundled["model"]).parent == default_model_dir()
    assert len(bundled["state_pairs"]) == 12


def test_missing_model_exits_2_with_the_file_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "model.onnx does not exist" in _error(capsys, str(tmp_path))


def test_truncated_model_exits_2_with_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_package(tmp_path, sig_model(base_inputs(), [logits_port()]))
    data = (tmp_path / "model.onnx").read_bytes()
    (tmp_path / "model.onnx").write_bytes(data[:-7])
    err = _error(capsys, str(tmp_path))
    assert "truncated" in err and "re-export" in err


def test_malformed_config_exits_2_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_package(tmp_path, sig_model(base_inputs(), [logits_port()]), {"genai_config.json": "{oops"})
    assert "genai_config.json is not valid JSON" in _error(capsys, str(tmp_path), "--json")


def test_ambiguous_ports_exit_2_with_how_to_declare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = sig_model([("a", "int64", ["b", "s"]), ("c", "int64", ["b", "s"])], [logits_port()])
    err = _error(capsys, str(write_package(tmp_path, model)))
    assert "could each be the token input" in err and "model: {io: {token_input: a}}" in err


@pytest.fixture(scope="module")
def scan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("scan"), "hybrid-scan")


def test_inspect_names_the_decode_plan_a_load_chooses_and_why(
    scan_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(scan_dir), "--json", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    llm = load(scan_dir, threads=1)
    ran = llm.generate([5, 6, 7], SamplingParams(max_new_tokens=2)).stats["decode_plan"]
    assert out["decode_plan"] == ran == llm.decode_plan.plan.name == "inline"
    assert out["decode_plan_check"] == "passed"
    assert "3 Scans" in out["decode_plan_reason"] and "of a decode step" in out["decode_plan_reason"]
    assert "checked: its first step equals the Scan plan's bit for bit" in out["decode_plan_reason"]
    assert main(["inspect", str(scan_dir), "--threads", "1"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("decode plan:"))
    assert line == f"decode plan:    inline ({out['decode_plan_reason']})"


def _nudged_logits(rewrites: Callable[..., onnx.ModelProto]) -> Callable[..., onnx.ModelProto]:
    """``SessionGraph.same_rewrites`` whose sibling adds 1e-6 to every logit: the inline plan then
    differs from the Scan plan in the last bits, as a graph that rounds differently once inlined does."""

    def rewrite(self: SessionGraph, graph: onnx.ModelProto, base_dir: Path) -> onnx.ModelProto:
        graph = rewrites(self, graph, base_dir)
        name = self.io.logits
        producer = next(n for n in graph.graph.node if name in n.output)
        producer.output[list(producer.output).index(name)] = f"{name}_raw"
        graph.graph.initializer.append(numpy_helper.from_array(np.array(1e-6, np.float32), "nudge"))
        graph.graph.node.append(helper.make_node("Add", [f"{name}_raw", "nudge"], [name]))
        return graph

    return rewrite


def test_inspect_and_validate_name_the_scan_plan_where_the_inline_plans_check_fails(
    scan_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(SessionGraph, "same_rewrites", _nudged_logits(SessionGraph.same_rewrites))
    assert main(["inspect", str(scan_dir), "--json", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    llm = load(scan_dir, threads=1)
    ran = llm.generate([5, 6, 7], SamplingParams(max_new_tokens=2)).stats["decode_plan"]
    assert out["decode_plan"] == ran == "scan" and out["decode_plan_check"] == "failed"
    reason = out["decode_plan_reason"]
    assert "the inline plan was chosen" in reason and "3 Scans" in reason
    assert "differs from the Scan graph's on a first step" in reason and "decoding on the Scan plan" in reason
    assert main(["inspect", str(scan_dir), "--threads", "1"]) == 0
    assert f"decode plan:    scan ({reason})" in capsys.readouterr().out
    report = validate(scan_dir, self_check=True, prompts=["5 6 7 8"], new_tokens=2, threads=1)
    assert report.decode_plan == "scan" and report.to_json()["decode_plan_reason"] == reason


def test_inspect_says_a_model_without_scans_decodes_on_its_main_graph(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dense = build_model(tmp_path, "genai-dense")
    assert main(["inspect", str(dense), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decode_plan"] == "main" and "no Scan" in out["decode_plan_reason"]
    assert main(["inspect", str(dense)]) == 0
    assert "decode plan:    main (no eligible Scan" in capsys.readouterr().out


def test_inspect_says_what_the_fast_ops_pass_does_as_a_load_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], scan_dir: Path
) -> None:
    fused = build_model(tmp_path / "fused", "hybrid-genai")
    assert main(["inspect", str(fused), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    n = len(load(fused, threads=1).session.fast_ops.rewritten)
    assert n >= 2 and out["fast_ops"].startswith(f"{n} hybrid ops on vectorized kernels")
    assert main(["inspect", str(fused)]) == 0
    assert f"fast ops:       {out['fast_ops']}" in capsys.readouterr().out
    assert main(["inspect", str(scan_dir), "--json"]) == 0  # a hybrid whose recurrence is a Scan
    assert json.loads(capsys.readouterr().out)["fast_ops"] == "nothing to rewrite"
    dense = build_model(tmp_path / "dense", "genai-dense")
    assert main(["inspect", str(dense), "--json"]) == 0
    assert "fast_ops" not in json.loads(capsys.readouterr().out)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_inspect_memory_splits_the_resident_memory_of_a_load_and_a_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ONNXGEN_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = build_model(tmp_path / "m", "genai-dense", precision="int4")
    flags = ["--memory", "--threads", "1", "--prompt-tokens", "5", "--new-tokens", "3"]
    # in a fresh process, as a user runs it: a test process's heap already holds freed memory that a
    # tiny model's load reuses, so the load's heap delta could be zero or less there
    done = subprocess.run(
        [sys.executable, "-m", "onnxgen", "inspect", str(model_dir), *flags, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    # TinySpec(): 4 layers of 2 KV heads of 16, fp32, shared buffers of prompt + new tokens
    assert r["kv_state_buffers_mb"] * (1 << 20) == pytest.approx(4 * 2 * 2 * 8 * 16 * 4)
    # one thread: the sibling projections are left separate (onnxgen.graph.decode_fusions.merge_pays)
    assert r["prepared_graph"] == "miss" and "left separate on one thread" in r["decode_fusions"]
    assert r["load_heap_mb"] > 0 and r["python_before_load_mb"] > 10
    assert r["weights_resident_mb"] <= r["weights_mapped_mb"]
    assert r["rss_after_load_mb"] <= r["peak_during_load_mb"] + 1 <= r["peak_rss_mb"] + 1  # smaps vs rusage
    assert all(f.startswith(str(model_dir)) or "graphs" in f for f in r["weight_files"])
    assert main(["inspect", str(model_dir), *flags]) == 0
    text = capsys.readouterr().out
    assert "prepared graph: hit" in text and "heap added by the load" in text


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai", "hybrid-mobius"])
def test_inspect_prepares_the_model_without_an_onnxruntime_session_where_no_check_must_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """The graph passes run (or are read from the cache) and the decode plan is chosen with no session;
    what inspect says is what the passes' dry runs on the export say and what a load's session has."""
    import onnxruntime

    from onnxgen.graph.decode_fusions import planned_fusions
    from onnxgen.graph.hybrid_ops import apply_fast_ops
    from onnxgen.model import ModelPackage

    model_dir = build_model(tmp_path / family, family, precision="int4")

    def no_session(*args: object, **kwargs: object) -> None:
        raise AssertionError("inspect made an onnxruntime session")

    monkeypatch.setattr(onnxruntime, "InferenceSession", no_session)
    outs = []
    for _ in range(2):  # the first prepares the graph, the second reads it from the cache
        assert main(["inspect", str(model_dir), "--json", "--threads", "2"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1]
    with pytest.raises(Exception, match="inspect made an onnxruntime session"):  # the patch catches a load
        load(model_dir, threads=1)
    monkeypatch.undo()
    out, package = outs[0], ModelPackage.open(model_dir)
    assert out["decode_plan"] == "main" and out["decode_plan_check"] == "not needed"
    assert out["decode_fusions"] == planned_fusions(package.graph).summary()
    llm = load(model_dir, threads=2)
    assert "merged" in out["decode_fusions"] and out["decode_fusions"] == llm.session.fusions.summary()
    if family.startswith("hybrid"):
        assert out["fast_ops"] == apply_fast_ops(package.graph, None).report.summary()
        assert out["fast_ops"] == llm.session.fast_ops.summary()
    else:
        assert "fast_ops" not in out
