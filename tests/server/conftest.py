"""Tiny models for the server tests (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_helpers import CACHE_VARIANTS, INT8_ACTIVATIONS, int8_activation_model

from onnxgen.testing import build_model


@pytest.fixture(scope="session")
def server_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-models")
    models = {
        family: build_model(root / family, family)
        for family in ("genai-dense", "hybrid-genai", "hybrid-mobius")
    }
    models[INT8_ACTIVATIONS] = int8_activation_model(root / INT8_ACTIVATIONS)
    for family, kv in CACHE_VARIANTS.items():  # a stacked (GPT-2 style) and a static KV cache
        base = family.rsplit("-", 1)[0]
        models[family] = build_model(root / family, base, kv=kv)
    return models
