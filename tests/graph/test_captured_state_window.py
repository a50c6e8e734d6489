"""Captured state-node inputs + commit graph (strategy (c)) on every hybrid export family."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from test_scan_state_window import DRAFT, PROMPT, Runner

from onnxgen.graph.state_capture import capture_state_inputs, commit_graph, conv_state_after, cut_tokens
from onnxgen.model import ModelPackage
from onnxgen.testing import TinySpec, build_model

ELEM = {"tensor(float)": TensorProto.FLOAT}


@pytest.fixture(scope="module", params=["hybrid-genai", "hybrid-mobius", "hybrid-scan"])
def hybrid_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp(request.param), request.param, TinySpec.hybrid())


def _pairs(model_dir: Path) -> list[tuple[str, str]]:
    return [(p.input, p.output) for p in ModelPackage.open(model_dir).io.state_pairs]


def _load(model_dir: Path) -> onnx.ModelProto:
    return onnx.load(str(model_dir / "model.onnx"), load_external_data=False)


def test_every_state_is_captured_as_a_replayed_node_or_a_conv_window(hybrid_dir: Path) -> None:
    model = _load(hybrid_dir)
    done = capture_state_inputs(model, _pairs(hybrid_dir))
    out, result = done.model, done.report
    assert not result.skipped, result.skipped
    assert {w.present for w in result.windows} == {p for _, p in _pairs(hybrid_dir) if "conv" in p}
    assert {r.node.op_type for r in result.replays} == {
        "Scan" if "scan" in hybrid_dir.name else "LinearAttention"
    }
    assert len(out.graph.node) == len(model.graph.node), "captures add no node"
    assert [o.name for o in out.graph.output][: len(model.graph.output)] == [
        o.name for o in model.graph.output
    ]
    assert len(out.graph.output) > len(model.graph.output) == 1 + 6 + 2


def test_replaying_the_captures_gives_the_states_of_fresh_runs_over_each_prefix(hybrid_dir: Path) -> None:
    done = capture_state_inputs(_load(hybrid_dir), _pairs(hybrid_dir))
    out, result = done.model, done.report
    run = Runner(hybrid_dir, out)
    sess_ports = (*run.sess.get_inputs(), *run.sess.get_outputs())
    ports = {p.name: (ELEM[p.type], p.shape) for p in sess_ports if p.type in ELEM}
    commit = ort.InferenceSession(
        commit_graph(result.replays, ports, out).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    before = run.pasts_after(run.run(run.empty(), PROMPT))
    verify = run.run(before, DRAFT)
    recurrent = next(s[2] for r in result.replays for s in r.states.values())
    by_prefix = []
    for kept in range(1, len(DRAFT) + 1):
        fresh = run.run(before, DRAFT[:kept])
        feeds = {s[1]: before[s[1]] for r in result.replays for s in r.states.values()}
        for r in result.replays:
            feeds.update(
                {n: cut_tokens(verify[n], r.token_axes[slot], kept) for slot, n in r.captures.items()}
            )
        got = dict(zip([o.name for o in commit.get_outputs()], commit.run(None, feeds), strict=True))
        for w in result.windows:
            got[w.present] = np.empty_like(before[w.past])
            conv_state_after(before[w.past], verify[w.capture], kept, w.axis, got[w.present])
        for name, want in ((p, fresh[p]) for _, p in _pairs(hybrid_dir)):
            if kept == 1 and "scan" in hybrid_dir.name:
                # The fresh one-token forward's Conv and MatMuls take one-row kernels that round differently
                # from the multi-row verify whose captures are replayed: equal to float32 rounding only.
                np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-5, err_msg=name)
            else:
                assert np.array_equal(got[name], want), f"{name} after {kept} tokens"
        by_prefix.append(got[recurrent])
    assert not np.array_equal(by_prefix[0], by_prefix[-1]), "the states after different prefixes must differ"


def test_the_capture_graph_answers_ordinary_forwards_bit_identically(hybrid_dir: Path) -> None:
    model = _load(hybrid_dir)
    done = capture_state_inputs(model, _pairs(hybrid_dir))
    out, _ = done.model, done.report
    plain, rewritten = Runner(hybrid_dir, model), Runner(hybrid_dir, out)
    for tokens in (PROMPT, PROMPT[:1]):
        a, b = plain.run(plain.empty(), tokens), rewritten.run(rewritten.empty(), tokens)
        assert set(a) < set(b)
        for name, value in a.items():
            assert np.array_equal(value, b[name]), name


@pytest.mark.parametrize("kept", [1, 2, 3, 4, 6])
def test_the_conv_state_after_a_prefix_is_the_last_columns_of_past_and_kept_inputs(kept: int) -> None:
    past = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    x = 100 + np.arange(2 * 4 * 6, dtype=np.float32).reshape(2, 4, 6)
    out = np.full_like(past, -1)
    conv_state_after(past, x, kept, 2, out)
    columns = [past[:, :, i] for i in range(3)] + [x[:, :, i] for i in range(kept)]  # in time order
    assert np.array_equal(out, np.stack(columns[-3:], axis=2))


def _scan_model(directions: list[int] | None, outer: str | None) -> onnx.ModelProto:
    """A one-state Scan summing its scan input into the state; the body adds ``outer`` when given."""
    body_nodes = [helper.make_node("Add", ["s", "x_t"], ["s2"])]
    if outer is not None:
        body_nodes.append(helper.make_node("Add", ["s2", outer], ["s3"]))
    last = "s3" if outer is not None else "s2"
    body_nodes.append(helper.make_node("Identity", [last], ["y_t"]))
    body = helper.make_graph(
        body_nodes,
        "body",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2]) for n in ("s", "x_t")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2]) for n in (last, "y_t")],
    )
    attrs: dict[str, object] = {"body": body, "num_scan_inputs": 1, "scan_input_axes": [1]}
    if directions is not None:
        attrs["scan_input_directions"] = directions
    scan = helper.make_node("Scan", ["past", "x"], ["present", "y"], **attrs)
    inits = [helper.make_tensor("bias", TensorProto.FLOAT, [1, 2], [0.5, 0.5])]
    graph = helper.make_graph(
        [scan],
        "g",
        [
            helper.make_tensor_value_info("past", TensorProto.FLOAT, [1, 2]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "t", 2]),
        ],
        [
            helper.make_tensor_value_info("present", TensorProto.FLOAT, [1, 2]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "t", 2]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_a_scan_body_reading_an_outer_initializer_gets_it_copied_into_the_commit_graph() -> None:
    done = capture_state_inputs(_scan_model(None, "bias"), [("past", "present")])
    out, result = done.model, done.report
    (replay,) = result.replays
    assert [t.name for t in replay.initializers] == ["bias"]
    ports = {"past": (TensorProto.FLOAT, [1, 2]), replay.captures[1]: (TensorProto.FLOAT, [1, "t", 2])}
    commit = ort.InferenceSession(commit_graph(result.replays, ports, out).SerializeToString())
    x = np.arange(8, dtype=np.float32).reshape(1, 4, 2)
    (state,) = commit.run(None, {"past": np.zeros((1, 2), np.float32), replay.captures[1]: x[:, :3]})
    assert np.array_equal(state, x[0, :3].sum(axis=0, keepdims=True) + 3 * 0.5)


@pytest.mark.parametrize(
    "directions,outer,reason",
    [([1], None, "reverse"), (None, "not_a_constant", "not an inline initializer")],
)
def test_scans_that_cannot_be_replayed_on_a_prefix_are_left_alone_with_the_reason(
    directions: list[int] | None, outer: str, reason: str
) -> None:
    model = _scan_model(directions, outer)
    if outer == "not_a_constant":
        model.graph.input.append(helper.make_tensor_value_info(outer, TensorProto.FLOAT, [1, 2]))
    done = capture_state_inputs(model, [("past", "present")])
    out, result = done.model, done.report
    assert out is model and not result.replays
    assert reason in result.skipped["present"]
