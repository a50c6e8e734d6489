"""int4 (MatMulNBits) exports load, generate, and stay close to their fp32 twins."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import onnxgen
from onnxgen import SamplingParams
from onnxgen.model import ModelPackage
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession
from onnxgen.testing import build_model

FAMILIES = ("genai-dense", "hybrid-genai")
PROMPT = [5, 17, 200, 33, 44, 91, 12, 8]
CONTINUATION = [40, 7, 300, 41, 99, 60, 61, 62, 63, 64, 65, 66]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("int4")
    return {
        (family, precision): build_model(root / f"{family}-{precision}", family, precision=precision)
        for family in FAMILIES
        for precision in ("fp32", "int4")
    }


def teacher_forced_logits(model_dir: Path) -> np.ndarray:
    package = ModelPackage.open(model_dir)
    session = DecoderSession(session_graph(package.model_path, package.io), threads=1)
    state = session.new_state(len(PROMPT) + len(CONTINUATION))
    rows = [session.forward(state, np.asarray([PROMPT]))[0, -1]]
    rows += [session.forward(state, np.asarray([[t]]))[0, -1] for t in CONTINUATION]
    return np.stack(rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_int4_logits_are_finite_and_close_to_fp32_on_the_same_tokens(
    model_dirs: dict[tuple[str, str], Path], family: str
) -> None:
    fp32 = teacher_forced_logits(model_dirs[(family, "fp32")])
    int4 = teacher_forced_logits(model_dirs[(family, "int4")])
    assert np.isfinite(int4).all()
    assert not np.array_equal(int4, fp32)  # it is really quantized
    diff = np.abs(int4 - fp32)
    assert diff.mean() < 0.25 * fp32.std()
    for a, b in zip(fp32, int4, strict=True):  # every step's logits still rank tokens alike
        assert np.corrcoef(a, b)[0, 1] > 0.9


@pytest.mark.parametrize("family", FAMILIES)
def test_int4_models_generate_greedily_and_deterministically(
    model_dirs: dict[tuple[str, str], Path], family: str
) -> None:
    llm = onnxgen.load(model_dirs[(family, "int4")], threads=1)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    result = llm.generate("The quick brown fox", params)
    assert result.finish_reason == "length" and len(result.token_ids) == 12
    assert all(0 <= t < llm.session.vocab_size for t in result.token_ids)
    assert llm.generate("The quick brown fox", params).token_ids == result.token_ids
    sampled = llm.generate("The quick brown fox", SamplingParams(max_new_tokens=12, temperature=1.0, seed=3))
    assert 1 <= len(sampled.token_ids) <= 12
