"""The automatic prefix-cache budget: a tenth of the available memory, capped, and what chat uses."""

from __future__ import annotations

import pytest

from onnxgen.cache import prefix
from onnxgen.cache.prefix import AUTO_PREFIX_CACHE_MAX_MB, MB, auto_prefix_cache_mb


@pytest.mark.parametrize(
    ("available", "expected"),
    [(2_000 * MB, 200.0), (64_000 * MB, AUTO_PREFIX_CACHE_MAX_MB), (None, AUTO_PREFIX_CACHE_MAX_MB)],
)
def test_the_budget_is_a_tenth_of_the_available_memory_at_most_the_cap(
    monkeypatch: pytest.MonkeyPatch, available: int | None, expected: float
) -> None:
    monkeypatch.setattr(prefix.memory, "available_bytes", lambda: available)
    assert auto_prefix_cache_mb() == expected


def test_chat_takes_the_automatic_budget_and_zero_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from onnxgen.cli import build_parser
    from onnxgen.cli.generate import engine_config

    monkeypatch.setattr(prefix.memory, "available_bytes", lambda: 3_000 * MB)
    auto = engine_config(build_parser().parse_args(["chat"]))
    assert auto.prefix_cache_mb == 300.0
    off = engine_config(build_parser().parse_args(["chat", "--prefix-cache-mb", "0"]))
    assert off.prefix_cache_mb == 0
    one_shot = engine_config(build_parser().parse_args(["generate", "hi"]))
    assert one_shot.prefix_cache_mb == 0  # a single completion keeps nothing for a next request
