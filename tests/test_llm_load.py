"""How onnxgen.load makes its session and tokenizer: the tokenizer is parsed on another thread while
onnxruntime initializes the session, and the session is the one onnxruntime's wrapper makes."""

from __future__ import annotations

import importlib
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tokenizers

import onnxgen
from onnxgen import SamplingParams, TokenizerError
from onnxgen.errors import UnsupportedModelError
from onnxgen.model import ModelPackage
from onnxgen.runtime.binding import OrtInternals
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession, make_session_options
from onnxgen.testing import build_model

C = importlib.import_module("onnxruntime.capi._pybind_state")
PROMPT = "Hello, world"
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("load") / "dense", "genai-dense")


def _record_parses(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event set when tokenizers starts parsing a tokenizer.json (in this process, from now on)."""
    parsing = threading.Event()
    real = tokenizers.Tokenizer.from_file

    def from_file(path: str) -> tokenizers.Tokenizer:
        parsing.set()
        return real(path)

    monkeypatch.setattr(tokenizers.Tokenizer, "from_file", staticmethod(from_file))
    return parsing


def test_the_tokenizer_is_parsed_while_onnxruntime_initializes_the_session(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parse holds the GIL, so it must not start before the load's thread is inside onnxruntime's
    session initialization (which releases the GIL): not while the model is read, not after the session
    is made."""
    parsing = _record_parses(monkeypatch)
    seen: dict[str, bool] = {}
    real_init = C.InferenceSession.initialize_session

    def initialize_session(self: Any, *args: Any) -> None:
        seen["parsing before initialize"] = parsing.is_set()
        # the parse starts while this call runs (before it returns) when the load asked for it just before
        seen["parsing during initialize"] = parsing.wait(timeout=10)
        real_init(self, *args)

    monkeypatch.setattr(C.InferenceSession, "initialize_session", initialize_session)
    llm = onnxgen.load(model_dir, threads=1)
    assert seen == {"parsing before initialize": False, "parsing during initialize": True}
    assert llm.tokenizer is not None
    assert llm.generate(PROMPT, GREEDY).text


def test_a_load_from_another_thread_generates_as_one_from_the_main_thread(model_dir: Path) -> None:
    expected = onnxgen.load(model_dir, threads=1).generate(PROMPT, GREEDY)
    out: dict[str, Any] = {}

    def load() -> None:
        llm = onnxgen.load(model_dir, threads=1)
        out["result"] = llm.generate(PROMPT, GREEDY)

    worker = threading.Thread(target=load)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert out["result"].token_ids == expected.token_ids and out["result"].text == expected.text


def test_a_broken_tokenizer_json_fails_the_load_naming_the_file(model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json cannot be loaded .*re-export the tokenizer"):
        onnxgen.load(broken, threads=1)


def test_a_session_that_fails_to_load_raises_without_parsing_the_tokenizer(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The waiting tokenizer thread is released, not left parsing or blocking the failed load."""
    parsing = _record_parses(monkeypatch)

    def refuse(*args: Any) -> None:
        raise RuntimeError("no such op")

    monkeypatch.setattr(C, "InferenceSession", refuse)
    done: dict[str, BaseException] = {}

    def load() -> None:
        try:
            onnxgen.load(model_dir, threads=1)
        except BaseException as e:  # handed to the test thread
            done["error"] = e

    worker = threading.Thread(target=load)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the failed load waited on its tokenizer thread"
    assert isinstance(done["error"], UnsupportedModelError) and "no such op" in str(done["error"])
    assert not parsing.is_set()


def _greedy_logits(session: DecoderSession, steps: int = 4) -> list[np.ndarray]:
    state = session.new_state(16)
    logits = [session.forward(state, np.asarray([[5, 17, 200]]))[0, -1]]
    for _ in range(steps):
        logits.append(session.forward(state, np.asarray([[int(np.argmax(logits[-1]))]]))[0, -1])
    return logits


def test_the_session_made_in_two_calls_runs_as_the_wrappers(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same ports, providers, options and forwards (bit for bit) as a session from ``ort.InferenceSession``,
    which the load falls back to where this onnxruntime lacks the internals."""
    package = ModelPackage.open(model_dir)
    graph = session_graph(package.model_path, package.io)
    two_calls = DecoderSession(graph, threads=1)
    monkeypatch.delattr(ort.InferenceSession, "_from_initialized_c_session")
    wrapper = DecoderSession(graph, threads=1)
    a, b = two_calls.session, wrapper.session
    assert [(p.name, p.type, p.shape) for p in a.get_inputs() + a.get_outputs()] == [
        (p.name, p.type, p.shape) for p in b.get_inputs() + b.get_outputs()
    ]
    assert a.get_providers() == b.get_providers() == ["CPUExecutionProvider"]
    assert a.get_session_options().intra_op_num_threads == b.get_session_options().intra_op_num_threads == 1
    for got, want in zip(_greedy_logits(two_calls), _greedy_logits(wrapper), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("internals", [True, False], ids=["two calls", "wrapper"])
def test_the_hook_runs_once_after_the_graph_is_read(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, internals: bool
) -> None:
    """Between reading the graph and initializing; first where the wrapper makes the session instead."""
    if not internals:
        monkeypatch.delattr(ort.InferenceSession, "_from_initialized_c_session")
    made: list[str] = []
    real_make = C.InferenceSession

    def make(*args: Any) -> Any:
        made.append("read")
        return real_make(*args)

    monkeypatch.setattr(C, "InferenceSession", make)
    path = str(model_dir / "model.onnx")
    session = OrtInternals.session(
        path, make_session_options(1), ["CPUExecutionProvider"], lambda: made.append("hook")
    )
    assert made == (["read", "hook"] if internals else ["hook", "read"])
    assert isinstance(session, ort.InferenceSession) and session.get_inputs()
