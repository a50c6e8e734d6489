"""Tiny models for the speculative-decoding tests, built on first use and shared by the whole session."""

from __future__ import annotations

from pathlib import Path

import pytest
from mtp_helpers import MTPZoo
from speculative_helpers import ModelZoo


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> ModelZoo:
    return ModelZoo(tmp_path_factory.mktemp("speculative-models"))


@pytest.fixture(scope="session")
def zoo_root(zoo: ModelZoo) -> Path:
    return zoo.root


@pytest.fixture(scope="session")
def mtp_zoo(tmp_path_factory: pytest.TempPathFactory) -> MTPZoo:
    return MTPZoo(tmp_path_factory.mktemp("mtp-models"))
