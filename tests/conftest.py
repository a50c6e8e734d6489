"""Test-session settings shared by every test folder."""

from __future__ import annotations

import os
import tempfile

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # Decode plans cache optimized model copies; keep the tests' copies out of the user's cache.
    if "ONNXGEN_CACHE_DIR" not in os.environ:
        os.environ["ONNXGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="onnxgen-test-cache-")
    # Hub ids resolve from the Hugging Face cache: the tests see an empty one of their own, never the user's.
    os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="onnxgen-test-hf-cache-")


@pytest.fixture(autouse=True)
def _fresh_plan_warnings() -> None:
    """Each test sees the decode-plan warnings its own loads give (a process says each once per model)."""
    from onnxgen.runtime import decode_routing

    decode_routing._WARNED.clear()
