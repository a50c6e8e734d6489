"""onnxgen.runtime.binding: the onnxruntime internals the decode lane uses exist on the installed onnxruntime,
the lane really runs on them, and no other module touches a private name of onnxruntime."""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from runtime_helpers import PROMPT, ids

from onnxgen.runtime.binding import OrtInternals, PrivateAttribute
from onnxgen.runtime.session import DecoderSession

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "onnxgen"
STEPS = [40, 7, 300, 41, 2, 99]


def _roots(session: DecoderSession) -> dict[str, Any]:
    """An instance of each onnxruntime class :attr:`OrtInternals.ATTRIBUTES` names."""
    return {
        "onnxruntime.InferenceSession": session.session,
        "onnxruntime.IOBinding": session.session.io_binding(),
        "onnxruntime.OrtValue": ort.OrtValue.ortvalue_from_numpy(np.zeros(2, dtype=np.int64)),
    }


@pytest.mark.parametrize("attr", OrtInternals.ATTRIBUTES, ids=lambda a: f"{a.owner}.{a.path}")
def test_onnxruntime_has_each_private_attribute_onnxgen_uses(
    sessions: dict[str, DecoderSession], attr: PrivateAttribute
) -> None:
    roots = _roots(sessions["genai-dense"])
    obj = roots[attr.owner] if attr.owner in roots else importlib.import_module(attr.owner)
    for part in attr.path.split("."):
        assert hasattr(obj, part), (
            f"onnxruntime {ort.__version__} has no {attr.owner}.{attr.path} ({part!r} is missing), which "
            f"onnxgen uses for: {attr.why}. Update onnxgen.runtime.binding.OrtInternals for this release"
        )
        obj = getattr(obj, part)
    assert callable(obj) or attr.path == "_ortvalue"
    assert OrtInternals.missing(*_roots(sessions["genai-dense"]).values()) == []


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai"])
def test_the_decode_lane_runs_on_onnxruntimes_own_objects(
    sessions: dict[str, DecoderSession], family: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Steady steps take the lane, and the lane calls the C session's run with the C binding: the fast
    path binds for real on this onnxruntime, it does not fall back to the wrappers."""
    session = sessions[family]
    state = session.new_state(64)
    session.forward(state, ids(PROMPT), 1)
    before = session.lane_steps
    with caplog.at_level(logging.WARNING, logger="onnxgen.runtime.binding"):
        for t in STEPS:
            session.step(state, t)
    assert session.lane_steps - before >= len(STEPS) - 2  # the first two steps make the lanes
    lane = state.bindings.lanes[state.steps & 1]
    assert lane is not None
    assert lane.run.__self__ is session.session._sess
    assert lane.binding is lane.binder.binding._iobinding
    assert not caplog.records


class _Unknown:
    """An IOBinding of an onnxruntime that renamed its C object."""

    def __init__(self, binding: ort.IOBinding) -> None:
        self.binding = binding

    def __getattr__(self, name: str) -> Any:
        if name == "_iobinding":
            raise AttributeError(name)
        return getattr(self.binding, name)


def test_a_renamed_internal_falls_back_loudly_and_decodes_alike(
    sessions: dict[str, DecoderSession], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Negative control: where the C binding is missing, no lane is made, a warning names what is missing
    and the onnxruntime version, and steps still give the logits of ordinary forwards."""
    session = sessions["genai-dense"]
    io_binding, run = ort.InferenceSession.io_binding, ort.InferenceSession.run_with_iobinding
    monkeypatch.setattr(ort.InferenceSession, "io_binding", lambda self: _Unknown(io_binding(self)))
    monkeypatch.setattr(  # this onnxruntime's wrapper knows its own name for the C binding
        ort.InferenceSession, "run_with_iobinding", lambda self, b, o=None: run(self, b.binding, o)
    )
    monkeypatch.setattr(OrtInternals, "_warned", False)
    state, reference = session.new_state(64), session.new_state(64)
    session.forward(state, ids(PROMPT), 1)
    session.forward(reference, ids(PROMPT), 1)
    before = session.lane_steps
    with caplog.at_level(logging.WARNING, logger="onnxgen.runtime.binding"):
        for t in STEPS:
            np.testing.assert_array_equal(session.step(state, t), session.forward(reference, ids(t))[0, -1])
    assert session.lane_steps == before and state.bindings.lanes == [None, None]
    [record] = caplog.records
    assert "onnxruntime.IOBinding._iobinding.bind_ortvalue_input" in record.getMessage()
    assert ort.__version__ in record.getMessage()


def test_no_other_module_touches_a_private_name_of_onnxruntime() -> None:
    """Every use of onnxruntime's internals is in onnxgen.runtime.binding (where the test above checks it)."""
    names = {
        part for attr in OrtInternals.ATTRIBUTES for part in attr.path.split(".") if part.startswith("_")
    }
    pattern = re.compile(r"\.(" + "|".join(map(re.escape, sorted(names))) + r")\b|onnxruntime\.capi\._")
    found = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "binding.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert names == {"_sess", "_iobinding", "_ortvalue", "_from_initialized_c_session"}
    assert not found, "onnxruntime internals used outside onnxgen.runtime.binding:\n" + "\n".join(found)
