"""Tiny models for the server tests (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from onnxgen.testing import build_model


@pytest.fixture(scope="session")
def server_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-models")
    return {
        family: build_model(root / family, family)
        for family in ("genai-dense", "hybrid-genai", "hybrid-mobius")
    }
