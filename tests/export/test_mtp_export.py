"""The exported MTP head computes the published MTP forward, reads the decoder's embedding and lm_head in
place, and refuses heads it cannot build with a message naming what is wrong."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnxgen.errors import ModelPackageError
from onnxgen.export.mtp import MTP_DATA, MTP_FILE, write_mtp_head
from onnxgen.export.mtp_weights import LAYER, MTPGeometry
from onnxgen.model.mtp import find_mtp_head, mtp_head_io
from onnxgen.model.package import ModelPackage
from onnxgen.runtime.mtp_head import MTPHeadSession
from onnxgen.runtime.state import DecodeState
from onnxgen.testing import TinySpec, build_model, make_weights
from onnxgen.testing.graph import save_model
from onnxgen.testing.mtp import geometry_of, make_mtp_weights, mtp_reference
from onnxgen.testing.quant import Int4Weight, dequantize_int4

T = 9
SPLIT = (5, 1, 3)  # forwards over the entries: a catch-up, a chained step, another catch-up


def spec_of(family: str, head_dim: int = 16) -> TinySpec:
    return replace(TinySpec.hybrid() if family.startswith("hybrid") else TinySpec(), head_dim=head_dim)


# How the head applies its rotary embedding: inside GroupQueryAttention (``do_rotary``) where
# onnxruntime's kernel takes the width (a multiple of 16; here a quarter of 64-dim heads, as Qwen3.5),
# else with rotary nodes on the position ids (a quarter of 16-dim heads).
ROTARY = {"fused": 64, "nodes": 16}  # -> head_dim


def rotary_of(path: Path) -> str:
    """How the head at ``path`` applies its rotary embedding (and check the graph holds only that)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    gqa = next(n for n in graph.node if n.op_type == "GroupQueryAttention")
    fused = next(a.i for a in gqa.attribute if a.name == "do_rotary") == 1
    cos_nodes = [n for n in graph.node if n.op_type == "Cos"]
    assert fused == (len(gqa.input) == 9) and fused != bool(cos_nodes)
    return "fused" if fused else "nodes"


def entries(spec: TinySpec) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, spec.vocab_size, T)
    hidden = rng.standard_normal((T, spec.hidden)).astype(np.float32)
    return tokens, hidden


def head_session(model_dir: Path) -> MTPHeadSession:
    package = ModelPackage.open(model_dir)
    path = find_mtp_head(package)
    assert path is not None
    return MTPHeadSession(mtp_head_io(package, path), threads=1)


def run_in_chunks(
    head: MTPHeadSession, tokens: np.ndarray, hidden: np.ndarray
) -> tuple[list[np.ndarray], list[np.ndarray], DecodeState]:
    """The head over the entries in SPLIT forwards: the last logits and hidden state of each."""
    state = head.new_state(T + 4)
    logits, outs, start = [], [], 0
    for n in SPLIT:
        lo, h = head.forward(state, tokens[None, start : start + n], hidden[None, start : start + n])
        logits.append(lo)
        outs.append(h)
        start += n
    return logits, outs, state


@pytest.mark.parametrize("rotary", list(ROTARY))
@pytest.mark.parametrize("family", ["genai-dense", "standard-dense", "hybrid-mobius", "hybrid-scan"])
def test_the_fp32_head_matches_the_numpy_reference_of_the_mtp_forward_over_a_cached_run(
    tmp_path: Path, family: str, rotary: str
) -> None:
    spec = spec_of(family, ROTARY[rotary])
    d = build_model(tmp_path, family, spec)
    g = geometry_of(spec)
    w = make_mtp_weights(g, seed=3)
    report = write_mtp_head(d, g, w)
    assert report.precision == "fp32" and report.path == d / MTP_FILE
    assert rotary_of(report.path) == rotary
    tokens, hidden = entries(spec)
    logits, outs, state = run_in_chunks(head_session(d), tokens, hidden)
    dw = make_weights(spec)
    ref_logits, ref_hidden, ref_k, ref_v = mtp_reference(g, w, dw["embed"], dw["lm_head"], tokens, hidden)
    last = np.cumsum(SPLIT) - 1
    np.testing.assert_allclose(np.stack(logits), ref_logits[last], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.stack(outs), ref_hidden[last], rtol=1e-4, atol=1e-4)
    kv = state.kv_arrays()
    np.testing.assert_allclose(kv["past_key_values.0.key"][0], ref_k, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(kv["past_key_values.0.value"][0], ref_v, rtol=1e-4, atol=1e-4)


def test_the_reference_tells_a_head_with_the_concatenation_reversed(tmp_path: Path) -> None:
    # Negative control: the order of fc's inputs matters (embedding first); swapping the halves of fc's
    # weight is what a head that concatenated (hidden, embedding) computes, and the comparison sees it.
    spec = spec_of("genai-dense")
    d = build_model(tmp_path, "genai-dense", spec)
    g = geometry_of(spec)
    w = make_mtp_weights(g, seed=3)
    fc = w["mtp.fc.weight"]
    swapped = {**w, "mtp.fc.weight": np.concatenate([fc[:, g.hidden :], fc[:, : g.hidden]], axis=1)}
    write_mtp_head(d, g, swapped)
    tokens, hidden = entries(spec)
    logits, _, _ = run_in_chunks(head_session(d), tokens, hidden)
    dw = make_weights(spec)
    ref_logits = mtp_reference(g, w, dw["embed"], dw["lm_head"], tokens, hidden)[0]
    assert np.abs(np.stack(logits) - ref_logits[np.cumsum(SPLIT) - 1]).max() > 1e-2


@pytest.mark.parametrize("rotary", list(ROTARY))
def test_the_reference_tells_a_head_with_another_rotary_embedding(tmp_path: Path, rotary: str) -> None:
    # Negative control: the rotary embedding matters (both ways of applying it), so a head whose rotary
    # angles were off (here its base doubled) misses the reference.
    spec = spec_of("genai-dense", ROTARY[rotary])
    d = build_model(tmp_path, "genai-dense", spec)
    g = geometry_of(spec)
    w = make_mtp_weights(g, seed=3)
    write_mtp_head(d, replace(g, rope_theta=2 * g.rope_theta), w)
    assert rotary_of(d / MTP_FILE) == rotary
    tokens, hidden = entries(spec)
    logits, _, _ = run_in_chunks(head_session(d), tokens, hidden)
    dw = make_weights(spec)
    ref_logits = mtp_reference(g, w, dw["embed"], dw["lm_head"], tokens, hidden)[0]
    assert np.abs(np.stack(logits) - ref_logits[np.cumsum(SPLIT) - 1]).max() > 1e-3


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai", "hybrid-mobius"])
def test_the_decoders_rotary_caches_are_shared_where_they_are_the_heads(tmp_path: Path, family: str) -> None:
    # full rotary over 16-dim heads: the decoder's cos/sin tables ([positions, 8]) are the head's
    spec = spec_of(family)
    d = build_model(tmp_path, family, spec)
    g = geometry_of(spec, rotary_dim=spec.head_dim)
    w = make_mtp_weights(g, seed=3)
    report = write_mtp_head(d, g, w)
    assert rotary_of(report.path) == "fused"
    assert sorted(report.shared) == ["embed", "lm_head", "rope.cos_cache", "rope.sin_cache"]
    tokens, hidden = entries(spec)
    logits, outs, _ = run_in_chunks(head_session(d), tokens, hidden)
    dw = make_weights(spec)
    ref_logits, ref_hidden, _, _ = mtp_reference(g, w, dw["embed"], dw["lm_head"], tokens, hidden)
    last = np.cumsum(SPLIT) - 1
    np.testing.assert_allclose(np.stack(logits), ref_logits[last], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.stack(outs), ref_hidden[last], rtol=1e-4, atol=1e-4)
    # another base: the decoder's tables are not the head's, so it gets its own
    other = write_mtp_head(d, replace(g, rope_theta=500.0), w)
    assert sorted(other.shared) == ["embed", "lm_head"]


def dequantized(model_path: Path, weight: str) -> np.ndarray:
    """The float ``[K, N]`` weight a MatMulNBits node of ``model_path`` multiplies by (``weight``: its B)."""
    graph = onnx.load(str(model_path))
    node = next(n for n in graph.graph.node if n.op_type == "MatMulNBits" and n.input[1] == weight)
    inits = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
    attrs = {a.name: a.i for a in node.attribute}
    packed, scales = inits[node.input[1]], inits[node.input[2]].reshape(-1)
    return dequantize_int4(Int4Weight(packed, scales, attrs["K"], attrs["N"], attrs["block_size"]))


def held_weights(head_file: Path, g: MTPGeometry, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint-named weights an int4 head multiplies by: its projections dequantized, the fused
    ones (query, key, gate and value; the MLP's gate and up) cut back into the checkpoint's."""
    p, hd, h = LAYER + "self_attn.", g.head_dim, g.hidden
    out = dict(w)
    for name in ("mtp.fc", p + "o_proj", LAYER + "mlp.down_proj"):
        out[name + ".weight"] = dequantized(head_file, name + "_Q4").T
    qkv = dequantized(head_file, p + "qkv_proj_Q4").T  # rows: queries, key, gates, value
    q_rows, kv_rows = g.heads * hd, g.kv_heads * hd
    q, k, gate, v = np.split(qkv, np.cumsum([q_rows, kv_rows, q_rows]))
    out[p + "q_proj.weight"] = np.stack(
        [q.reshape(g.heads, hd, h), gate.reshape(g.heads, hd, h)], axis=1
    ).reshape(-1, h)
    out[p + "k_proj.weight"], out[p + "v_proj.weight"] = k, v
    gate_up = dequantized(head_file, LAYER + "mlp.gate_up_proj_Q4").T
    out[LAYER + "mlp.gate_proj.weight"], out[LAYER + "mlp.up_proj.weight"] = np.split(gate_up, 2)
    return out


@pytest.mark.parametrize("rotary", list(ROTARY))
def test_an_int4_decoder_gets_an_int4_head_that_computes_the_mtp_forward_on_its_quantized_weights(
    tmp_path: Path, rotary: str
) -> None:
    spec = spec_of("hybrid-genai", ROTARY[rotary])
    d = build_model(tmp_path, "hybrid-genai", spec, precision="int4")
    g = geometry_of(spec)
    w = make_mtp_weights(g, seed=3)
    report = write_mtp_head(d, g, w)
    assert report.precision == "int4" and report.accuracy_level == 0  # the decoder's
    assert sorted(report.shared) == ["embed", "lm_head.int4", "lm_head.scales"]
    head_file = d / MTP_FILE
    assert rotary_of(head_file) == rotary
    graph = onnx.load(str(head_file), load_external_data=False)
    # fc, qkv, o, gate_up, down + the lm_head
    assert len([n for n in graph.graph.node if n.op_type == "MatMulNBits"]) == 6
    # the reference on the weights the int4 head holds: each projection dequantized
    quantized = held_weights(head_file, g, w)
    for name, value in w.items():  # and they are the checkpoint's, rounded to int4
        scale = np.abs(value).max()
        assert np.abs(quantized[name] - value).max() < (0.2 * scale if value.ndim == 2 else 1e-7)
    lm_head = dequantized(d / "model.onnx", "lm_head.int4")
    tokens, hidden = entries(spec)
    logits = np.stack(run_in_chunks(head_session(d), tokens, hidden)[0])
    ref = mtp_reference(g, quantized, make_weights(spec)["embed"], lm_head, tokens, hidden)[0]
    np.testing.assert_allclose(logits, ref[np.cumsum(SPLIT) - 1], rtol=1e-4, atol=1e-4)


def test_the_head_reads_the_decoders_embedding_and_lm_head_in_its_data_file(tmp_path: Path) -> None:
    spec = spec_of("genai-dense")
    d = build_model(tmp_path, "genai-dense", spec)
    g = geometry_of(spec)
    report = write_mtp_head(d, g, make_mtp_weights(g))
    assert sorted(report.shared) == ["embed", "lm_head"] and report.copied == []
    graph = onnx.load(str(d / MTP_FILE), load_external_data=False)
    where = {
        t.name: {e.key: e.value for e in t.external_data}.get("location") for t in graph.graph.initializer
    }
    assert where["embed"] == where["lm_head"] == "model.onnx.data"
    assert where["mtp.fc"] == MTP_DATA
    own = sum(int(np.prod(v.shape)) * 4 for k, v in make_mtp_weights(g).items() if v.ndim == 2)
    shared = (spec.vocab_size * spec.hidden) * 2 * 4
    assert (d / MTP_DATA).stat().st_size < own + shared // 4, "the shared weights were copied"


def test_a_decoder_with_its_weights_inside_the_model_file_has_them_copied(tmp_path: Path) -> None:
    spec = spec_of("genai-dense")
    d = build_model(tmp_path, "genai-dense", spec)
    inline = onnx.load(str(d / "model.onnx"))  # weights loaded
    (d / "model.onnx.data").unlink()
    save_model(inline, d, external_data=False)
    g = geometry_of(spec)
    w = make_mtp_weights(g, seed=3)
    report = write_mtp_head(d, g, w)
    assert report.shared == [] and sorted(report.copied) == ["embed", "lm_head"]
    tokens, hidden = entries(spec)
    logits = np.stack(run_in_chunks(head_session(d), tokens, hidden)[0])
    dw = make_weights(spec)
    ref = mtp_reference(g, w, dw["embed"], dw["lm_head"], tokens, hidden)[0]
    np.testing.assert_allclose(logits, ref[np.cumsum(SPLIT) - 1], rtol=1e-4, atol=1e-4)


def test_a_tied_embedding_read_through_a_transpose_of_the_lm_head_is_shared_and_repeated(
    tmp_path: Path,
) -> None:
    """onnxruntime-genai's builder exports tied embeddings as ``Gather(Transpose(lm_head weight), ids)``:
    the head repeats the Transpose over the shared lm_head weight and computes the MTP forward with the
    embedding table ``lm_head.T``."""
    spec = spec_of("genai-dense")
    d = build_model(tmp_path, "genai-dense", spec)
    model = onnx.load(str(d / "model.onnx"))
    gather = next(n for n in model.graph.node if n.op_type == "Gather" and "input_ids" in n.input)
    table = onnx.helper.make_node("Transpose", ["lm_head"], ["tied_embed"], perm=[1, 0], name="tie")
    gather.input[0] = "tied_embed"
    model.graph.node.insert(0, table)
    kept = [t for t in model.graph.initializer if t.name != "embed"]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    (d / "model.onnx.data").unlink()
    save_model(model, d)
    g = geometry_of(spec)
    w = make_mtp_weights(g, seed=3)
    report = write_mtp_head(d, g, w)
    assert report.shared == ["lm_head"] and report.copied == []
    tokens, hidden = entries(spec)
    logits = np.stack(run_in_chunks(head_session(d), tokens, hidden)[0])
    lm_head = make_weights(spec)["lm_head"]
    ref = mtp_reference(g, w, lm_head.T, lm_head, tokens, hidden)[0]
    np.testing.assert_allclose(logits, ref[np.cumsum(SPLIT) - 1], rtol=1e-4, atol=1e-4)
    untied = mtp_reference(g, w, make_weights(spec)["embed"], lm_head, tokens, hidden)[0]
    assert not np.allclose(logits, untied[np.cumsum(SPLIT) - 1], atol=1e-3)  # the table matters


def test_a_decoder_data_file_linked_from_elsewhere_is_refused_with_the_fix(tmp_path: Path) -> None:
    # onnxruntime loads no external data from outside the model's directory, symlink targets included
    spec = spec_of("genai-dense")
    src = build_model(tmp_path / "src", "genai-dense", spec)
    d = tmp_path / "linked"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).symlink_to(f)
    g = geometry_of(spec)
    with pytest.raises(ModelPackageError, match="copy the export's files into one directory"):
        write_mtp_head(d, g, make_mtp_weights(g))
    assert not (d / MTP_FILE).exists()


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda w: w.pop("mtp.norm.weight"), "lacks MTP tensors mtp.norm.weight"),
        (lambda w: w.update({"mtp.layers.1.input_layernorm.weight": w["mtp.norm.weight"]}), "layers 0, 1"),
        (
            lambda w: w.update({LAYER + "mlp.experts.0.up_proj.weight": w["mtp.norm.weight"]}),
            "mixture-of-experts",
        ),
        (lambda w: w.update({"mtp.fc.weight": w["mtp.fc.weight"][:, :8]}), "disagree with config.json"),
    ],
)
def test_a_head_the_exporter_cannot_build_is_refused_by_name(
    tmp_path: Path, change: object, message: str
) -> None:
    spec = spec_of("genai-dense")
    d = build_model(tmp_path, "genai-dense", spec)
    g = geometry_of(spec)
    w = make_mtp_weights(g)
    change(w)  # type: ignore[operator]
    with pytest.raises(ModelPackageError, match=message):
        write_mtp_head(d, g, w)
    assert not (d / MTP_FILE).exists()


def test_a_head_of_another_hidden_size_is_refused(tmp_path: Path) -> None:
    d = build_model(tmp_path, "genai-dense", TinySpec())
    g = geometry_of(TinySpec(hidden=32, intermediate=64))
    with pytest.raises(ModelPackageError, match="hidden size 64 but the MTP head has 32"):
        write_mtp_head(d, g, make_mtp_weights(g))


def test_a_head_without_the_decoders_tables_gets_its_own_over_the_context_length(tmp_path: Path) -> None:
    # standard-dense computes its rotary with plain ops: nothing to share, so the head's own caches cover
    # the stated context length; with no length stated anywhere the head keeps rotary nodes (no bound)
    spec = spec_of("standard-dense", ROTARY["fused"])
    d = build_model(tmp_path, "standard-dense", spec)
    g = geometry_of(spec)
    w = make_mtp_weights(g, seed=3)
    report = write_mtp_head(d, g, w)
    assert rotary_of(report.path) == "fused" and "mtp.cos_cache" not in report.shared
    caches = {t.name: tuple(t.dims) for t in onnx.load(str(report.path)).graph.initializer}
    assert caches["mtp.cos_cache"] == caches["mtp.sin_cache"] == (spec.max_position, g.rotary_dim // 2)
    for name, keys in (
        ("genai_config.json", ("model", "context_length")),
        ("config.json", ("max_position_embeddings",)),
        ("tokenizer_config.json", ("model_max_length",)),
    ):
        path = d / name
        if not path.is_file():
            continue
        config = json.loads(path.read_text())
        (config[keys[0]] if len(keys) == 2 else config).pop(keys[-1], None)
        path.write_text(json.dumps(config))
    assert ModelPackage.open(d).context_length is None
    write_mtp_head(d, g, w)
    assert rotary_of(d / MTP_FILE) == "nodes"
    tokens, hidden = entries(spec)
    logits = np.stack(run_in_chunks(head_session(d), tokens, hidden)[0])
    dw = make_weights(spec)
    ref = mtp_reference(g, w, dw["embed"], dw["lm_head"], tokens, hidden)[0]
    np.testing.assert_allclose(logits, ref[np.cumsum(SPLIT) - 1], rtol=1e-4, atol=1e-4)
