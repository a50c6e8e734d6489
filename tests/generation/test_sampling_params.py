from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from onnxgen.errors import GenerationError
from onnxgen.generation.params import SamplingParams, SamplingParamsError


def test_defaults_are_greedy_with_64_new_tokens_and_no_stop_strings() -> None:
    params = SamplingParams()
    assert params.max_new_tokens == 64
    assert params.is_greedy
    assert params.stop == ()
    assert params.seed is None


def test_a_positive_temperature_is_not_greedy() -> None:
    assert not SamplingParams(temperature=0.7).is_greedy


def test_a_single_stop_string_is_accepted_and_stored_as_a_tuple() -> None:
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_params_are_frozen_and_hashable() -> None:
    params = SamplingParams(stop=["x"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0  # type: ignore[misc]
    assert hash(params) == hash(SamplingParams(stop=("x",)))


def test_replace_validates_the_new_values() -> None:
    with pytest.raises(SamplingParamsError, match="top_p"):
        dataclasses.replace(SamplingParams(), top_p=0.0)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"temperature": -1.0},
            "temperature must be a finite number >= 0 (got -1.0); use 0 for greedy decoding",
        ),
        ({"temperature": math.nan}, "temperature must be a finite number >= 0 (got nan)"),
        ({"temperature": "hot"}, "temperature must be a finite number >= 0 (got 'hot')"),
        (
            {"max_new_tokens": 0},
            "max_new_tokens must be an integer >= 1 (got 0); ask for at least one new token",
        ),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer >= 1 (got 2.5)"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer >= 1 (got True)"),
        ({"min_new_tokens": -1}, "min_new_tokens must be an integer >= 0 (got -1)"),
        ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens must be <= max_new_tokens (8) (got 9)"),
        ({"top_k": -2}, "top_k must be an integer >= 0 (got -2); use 0 to disable top-k filtering"),
        ({"top_p": 0.0}, "top_p must be in (0, 1] (got 0.0); use 1.0 to disable nucleus sampling"),
        ({"top_p": 1.5}, "top_p must be in (0, 1] (got 1.5)"),
        ({"min_p": 1.2}, "min_p must be in [0, 1] (got 1.2); use 0.0 to disable min-p filtering"),
        ({"min_p": -0.1}, "min_p must be in [0, 1] (got -0.1)"),
        (
            {"repetition_penalty": 0.0},
            "repetition_penalty must be a finite number >= 0.001 (got 0.0); use 1.0",
        ),
        ({"repetition_penalty": math.inf}, "repetition_penalty must be a finite number >= 0.001 (got inf)"),
        ({"repetition_penalty": 1e-308}, "repetition_penalty must be a finite number >= 0.001 (got 1e-308)"),
        ({"temperature": 1e-300}, "temperature must be 0 or at least 1e-05 (got 1e-300); use 0 for greedy"),
        ({"temperature": 5e-324}, "temperature must be 0 or at least 1e-05 (got 5e-324)"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2] (got 2.5); use 0.0 for no penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2] (got -3)"),
        ({"seed": -1}, "seed must be an integer >= 0 (got -1); use a non-negative integer, or None"),
        ({"seed": 1.0}, "seed must be an integer >= 0 (got 1.0)"),
        ({"stop": [""]}, "stop must be a list of non-empty strings (got ['']); pass a string or a list"),
        ({"stop": ["a", 3]}, "stop must be a list of non-empty strings (got ['a', 3])"),
        ({"stop": 7}, "stop must be a string or a list of strings (got 7)"),
        ({"ignore_eos": "yes"}, "ignore_eos must be a bool (got 'yes'); use True or False"),
        ({"detokenize": 0}, "detokenize must be a bool (got 0); use True or False"),
        (
            {"detokenize": False, "stop": ["\n\n"]},
            "detokenize must be True when stop strings are given (got False); stop strings ['\\n\\n'] "
            "are matched on decoded text; drop them or detokenize",
        ),
    ],
)
def test_each_invalid_value_raises_one_clear_error(kwargs: dict[str, object], expected: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert str(info.value).startswith(expected)


def test_the_error_is_both_a_value_error_and_a_generation_error() -> None:
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(GenerationError):
        SamplingParams(temperature=-1)


def test_boundary_values_are_accepted() -> None:
    params = SamplingParams(
        max_new_tokens=1,
        min_new_tokens=1,
        temperature=0,
        top_p=1.0,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2,
        seed=0,
    )
    assert params.is_greedy


def test_the_smallest_temperature_and_penalty_allowed_sample_finite_tokens(tmp_path: Path) -> None:
    from onnxgen import load
    from onnxgen.testing import build_model

    llm = load(build_model(tmp_path / "m", "genai-dense"), threads=1)
    greedy = llm.generate([5, 6, 7], max_new_tokens=8, ignore_eos=True).token_ids
    for params in (
        {"temperature": 1e-5, "seed": 0},
        {"temperature": 1e-5, "seed": 0, "repetition_penalty": 1e-3},
    ):
        tokens = llm.generate([5, 6, 7], max_new_tokens=8, ignore_eos=True, **params).token_ids
        assert len(tokens) == 8
        if "repetition_penalty" not in params:
            assert tokens == greedy  # so cold it is greedy
