"""The serial-attention rewrite: forwards of the chosen width run each attention position as its own
single-token call (a verify row computes what the decode step computes), every other forward is unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnxgen.graph.serial_attention import serialize_attention
from onnxgen.model import ModelPackage
from onnxgen.runtime.batch import lone_row_matches_block
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.verify_check import verify_matches_steps
from onnxgen.testing import TinySpec, build_model, int8_activations

WIDTH = 4
PROMPT = np.array([[5, 17, 200, 33, 44, 91, 12]], dtype=np.int64)
TOKENS = [40, 7, 300, 41, 99, 60]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serial")
    return int8_activations(build_model(root / "dense", "genai-dense", TinySpec(), precision="int4"))


def _session(model_dir: Path, serial: bool) -> DecoderSession:
    package = ModelPackage.open(model_dir)
    session = DecoderSession(session_graph(package.model_path, package.io), threads=1)
    if serial:
        assert session.serialize_verifies(WIDTH) is not None
    return session


def _steps(session: DecoderSession, prompt: np.ndarray, tokens: list[int]) -> list[np.ndarray]:
    state = session.new_state(32)
    session.forward(state, prompt, 1)
    return [session.step(state, t).copy() for t in tokens]


def test_the_pass_turns_each_attention_into_an_if_with_one_call_per_position(model_dir: Path) -> None:
    package = ModelPackage.open(model_dir)
    result = serialize_attention(package.graph, package.io.token_input, WIDTH)
    gqa = [n for n in package.graph.graph.node if n.op_type == "GroupQueryAttention"]
    assert result.modified and len(result.report.rewritten) == len(gqa) > 0
    ifs = [n for n in result.model.graph.node if n.op_type == "If"]
    assert len(ifs) == len(gqa)
    then = next(a.g for a in ifs[0].attribute if a.name == "then_branch")
    assert sum(n.op_type == "GroupQueryAttention" for n in then.node) == WIDTH
    for present, aliases in result.report.aliases.items():
        assert aliases == [f"{present}.serial{s}" for s in range(WIDTH - 1)]


def test_decode_steps_and_other_widths_compute_the_same_bits_as_before(model_dir: Path) -> None:
    plain, serial = _session(model_dir, False), _session(model_dir, True)
    for a, b in zip(_steps(plain, PROMPT, TOKENS), _steps(serial, PROMPT, TOKENS), strict=True):
        np.testing.assert_array_equal(a, b)
    for width in (2, 3, 5):  # multi-token forwards of another width take the graph as exported
        states = [s.new_state(32) for s in (plain, serial)]
        rows = [
            s.forward(st, np.array([TOKENS[:width]], dtype=np.int64))
            for s, st in zip((plain, serial), states, strict=True)
        ]
        np.testing.assert_array_equal(*rows)


def test_a_verify_of_the_width_equals_its_single_steps_where_rows_are_computed_alike(model_dir: Path) -> None:
    serial = _session(model_dir, True)
    check = verify_matches_steps(serial, WIDTH)
    if lone_row_matches_block(serial):  # MatMulNBits computes a lone row as a block's: the verify is exact
        assert check.exact, check.detail
    # without the rewrite the same verify is not exact where attention takes the single-row kernel
    plain = verify_matches_steps(_session(model_dir, False), WIDTH)
    assert plain.exact is False or check.exact


def test_a_prompt_of_exactly_the_width_is_prefilled_like_its_steps(model_dir: Path) -> None:
    serial = _session(model_dir, True)
    prompt = PROMPT[:, :WIDTH]
    whole = serial.new_state(32)
    rows = serial.forward(whole, prompt)[0]
    stepwise = serial.new_state(32)
    got = [serial.forward(stepwise, prompt[:, :1], 1)[0, -1].copy()]
    got += [serial.step(stepwise, int(t)).copy() for t in prompt[0, 1:]]
    np.testing.assert_array_equal(rows, np.stack(got))
    np.testing.assert_array_equal(serial.step(whole, 9), serial.step(stepwise, 9))


def test_each_position_must_write_the_cache_in_place(model_dir: Path) -> None:
    """The control: with the per-position present outputs left unbound, onnxruntime gives those calls
    buffers of their own, the cache misses the verify's first positions and the next step differs."""
    serial = _session(model_dir, True)
    ref = _steps(serial, PROMPT, TOKENS[: WIDTH + 1])
    serial._serial_aliases = {}  # what a forward binding none of them would leave
    state = serial.new_state(32)
    serial.forward(state, PROMPT, 1)
    serial.forward(state, np.array([TOKENS[:WIDTH]], dtype=np.int64))
    after = serial.step(state, TOKENS[WIDTH])
    assert not np.array_equal(after, ref[WIDTH])


def test_models_without_an_in_place_cache_are_left_alone(tmp_path: Path) -> None:
    model = build_model(tmp_path / "std", "standard-dense", TinySpec())
    session = _session_plain(model)
    assert session.serialize_verifies(WIDTH) is None and session.serial_width is None


def _session_plain(model_dir: Path) -> DecoderSession:
    package = ModelPackage.open(model_dir)
    return DecoderSession(session_graph(package.model_path, package.io), threads=1)
