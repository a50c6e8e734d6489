"""Tiny models of every export family, built once per test session, and DecoderSessions over them."""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_helpers import open_session, spec_of

from onnxgen.runtime.session import DecoderSession
from onnxgen.testing import FAMILIES, build_model


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder of the test's own (``ONNXGEN_CACHE_DIR``): prepared graphs start missing."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("ONNXGEN_CACHE_DIR", str(folder))
    return folder


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runtime-families")
    return {family: build_model(root / family, family, spec_of(family)) for family in FAMILIES}


@pytest.fixture(scope="session")
def sessions(family_dirs: dict[str, Path]) -> dict[str, DecoderSession]:
    return {family: open_session(path) for family, path in family_dirs.items()}
