"""How ``build_app`` / ``app_builder`` turn replica counts into Ray Serve's scaling options, and refuse bad
ones naming them, before any Ray instance exists. Skipped where Ray Serve is not installed."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from onnxgen.llm import default_model_dir
from onnxgen.serving.ray import app_builder, build_app, scaling_options


def test_a_fixed_count_or_an_autoscaling_range_on_requests_in_flight() -> None:
    assert scaling_options(3, None, None, 16) == {"num_replicas": 3}
    auto = scaling_options(2, 1, 4, 16)
    assert auto == {
        "num_replicas": "auto",
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16},
    }
    # one bound given: the other defaults to 1 (low) or to the larger of low and the fixed count (high)
    assert scaling_options(2, None, 5, 8)["autoscaling_config"]["min_replicas"] == 1
    assert scaling_options(2, 3, None, 8)["autoscaling_config"]["max_replicas"] == 3
    assert scaling_options(4, 0, None, 8)["autoscaling_config"]["max_replicas"] == 4  # scale to zero


@pytest.mark.parametrize(
    ("replicas", "low", "high", "target", "says"),
    [
        (0, None, None, 16, "replicas must be >= 1 (got 0)"),
        (2, 3, 2, 16, "need 0 <= min_replicas <= max_replicas and max_replicas >= 1 (got 3, 2)"),
        (2, 0, 0, 16, "(got 0, 0)"),
        (2, 1, 2, 0, "target_ongoing_requests must be > 0 (got 0)"),
    ],
)
def test_bad_counts_are_refused_naming_them(
    replicas: int, low: int | None, high: int | None, target: float, says: str
) -> None:
    with pytest.raises(ValueError) as error:
        scaling_options(replicas, low, high, target)
    assert says in str(error.value)


def test_build_app_checks_engine_sizes_and_retries_before_deploying() -> None:
    model = str(default_model_dir())
    with pytest.raises(ValueError, match="max_batch"):
        build_app(model, max_batch=0)
    with pytest.raises(ValueError, match=r"retries must be >= 0 .*got -1"):
        build_app(model, retries=-1)


def test_a_serve_config_s_text_args_are_converted_and_checked() -> None:
    with pytest.raises(ValueError, match=r"needs args\.model"):
        app_builder({"replicas": "2"})
    # numbers given as text are compared as numbers: a reversed range is refused by its values
    with pytest.raises(ValueError, match=r"\(got 3, 2\)"):
        app_builder({"model": str(default_model_dir()), "min_replicas": "3", "max_replicas": "2"})
    with pytest.raises(ValueError, match="max_queue"):
        app_builder({"model": str(default_model_dir()), "max_queue": "-1"})
    with pytest.raises(
        ValueError, match=r"unknown args.security no_such_field; known: allowed_hosts, api_key"
    ):
        app_builder({"model": str(default_model_dir()), "security": {"no_such_field": 1}})
    with pytest.raises(ValueError, match=r"unknown args replica; known: .*max_batch.*replicas"):
        app_builder({"model": str(default_model_dir()), "replica": "2"})
