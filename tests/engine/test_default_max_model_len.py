"""The default tokens per sequence: the model's context, cut to what the KV budget holds for the batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from onnxgen.config import DEFAULT_MAX_MODEL_LEN
from onnxgen.engine import limits
from onnxgen.engine.limits import default_max_model_len, row_bytes
from onnxgen.model import ModelPackage
from onnxgen.testing import TinySpec, build_model


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelPackage]:
    root = tmp_path_factory.mktemp("limits")
    return {
        "dense": ModelPackage.open(build_model(root / "dense", "genai-dense", TinySpec())),
        "hybrid": ModelPackage.open(build_model(root / "hybrid", "hybrid-genai", TinySpec.hybrid())),
    }


def _budget(monkeypatch: pytest.MonkeyPatch, nbytes: int | None) -> None:
    monkeypatch.setattr(limits.memory, "available_bytes", lambda: None if nbytes is None else nbytes * 4)


def test_a_row_costs_its_kv_per_token_and_its_states(packages: dict[str, ModelPackage]) -> None:
    io = packages["hybrid"].io
    per_token, states = row_bytes(io)
    kv = sum(len(p.inputs) * p.kv_heads * p.head_dim * 4 for p in io.kv_pairs)  # fp32 caches
    assert per_token == kv > 0
    assert states > 0 and row_bytes(packages["dense"].io)[1] == 0


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_the_context_is_the_default_where_the_budget_holds_it(
    packages: dict[str, ModelPackage], monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    io = packages[family].io
    per_token, states = row_bytes(io)
    context = 32768
    _budget(monkeypatch, 16 * (states + context * per_token))
    assert default_max_model_len(io, context, 16) == (context, "the model's context")


def test_a_context_the_budget_cannot_hold_is_cut_and_says_why(
    packages: dict[str, ModelPackage], monkeypatch: pytest.MonkeyPatch
) -> None:
    io = packages["hybrid"].io
    per_token, states = row_bytes(io)
    _budget(monkeypatch, 8 * (states + 5000 * per_token))
    length, why = default_max_model_len(io, 32768, 8)
    assert length == 5000
    assert why.startswith("cut from the model's context of 32768") and "--max-model-len" in why
    # never below DEFAULT_MAX_MODEL_LEN (or the context, where that is less)
    _budget(monkeypatch, 8 * (states + 10 * per_token))
    assert default_max_model_len(io, 32768, 8)[0] == DEFAULT_MAX_MODEL_LEN
    assert default_max_model_len(io, 300, 8)[0] == 300


def test_without_a_stated_context_or_a_readable_budget(
    packages: dict[str, ModelPackage], monkeypatch: pytest.MonkeyPatch
) -> None:
    io = packages["dense"].io
    assert default_max_model_len(io, None, 16)[0] == DEFAULT_MAX_MODEL_LEN
    _budget(monkeypatch, None)
    assert default_max_model_len(io, 9000, 16) == (9000, "the model's context")


def test_an_engine_takes_the_models_context_by_default(tmp_path: Path) -> None:
    import onnxgen

    llm = onnxgen.load(build_model(tmp_path / "m", "genai-dense", TinySpec()), threads=1)
    context = llm.package.context_length
    assert context is not None and context != DEFAULT_MAX_MODEL_LEN
    assert llm.engine().limits.max_model_len == default_max_model_len(llm.io, context, 16)[0]
