"""OpenAI's ``logit_bias`` as a logits processor (exact values on synthetic logits, validation, its place in
the chain) and OpenAI's closed-object reading of JSON schemas (the rewrite, and what the constraint lets
through under it and under the permissive switch)."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgen.generation.constraints import ConstraintCompiler, ConstraintError
from onnxgen.generation.params import SamplingParams, SamplingParamsError
from onnxgen.generation.processors import (
    LogitBias,
    RepetitionPenalty,
    SequenceView,
    Temperature,
    apply_chain,
    build_chain,
    choose,
)
from onnxgen.generation.schema_objects import close_objects
from onnxgen.testing import tiny_tokenizer
from onnxgen.tokenizer import Tokenizer

LOGITS = np.array([2.0, -1.0, 0.5, 3.0, -4.0], dtype=np.float32)
VOCAB = 320
EOS = 0


def view(generated: list[int]) -> SequenceView:
    return SequenceView(np.array([0, *generated], dtype=np.int64), 1)


# -- logit_bias -------------------------------------------------------------------------------------
def test_logit_bias_adds_each_bias_to_its_token_and_leaves_the_input_alone() -> None:
    before = LOGITS.copy()
    out = LogitBias([(1, 5.0), (3, -100.0)])(view([]), LOGITS)
    np.testing.assert_array_equal(out, np.array([2.0, 4.0, 0.5, -97.0, -4.0], dtype=np.float32))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(LOGITS, before)  # out of place


def test_logit_bias_biases_every_row_of_a_batch_alike() -> None:
    batch = np.stack([LOGITS, LOGITS * 2])
    out = LogitBias([(0, -1.5)])(view([]), batch)
    np.testing.assert_array_equal(out[:, 0], np.array([0.5, 2.5], dtype=np.float32))
    np.testing.assert_array_equal(out[:, 1:], batch[:, 1:])


def test_logit_bias_comes_first_in_the_chain_before_penalties_and_temperature() -> None:
    params = SamplingParams(logit_bias={3: -3.0}, repetition_penalty=2.0, temperature=0.5)
    chain = build_chain(params, [EOS])
    assert [type(p) for p in chain[:3]] == [LogitBias, RepetitionPenalty, Temperature]
    # id 3 was generated: biased first (3.0 - 3.0 = 0.0), then penalised (0 / 2) and scaled: 0.0; the other
    # order would give (3.0 / 2 - 3.0) / 0.5 = -3.0. Id 2, neither biased nor seen: 0.5 / 0.5
    out = apply_chain(chain, view([3]), LOGITS)
    assert out[3] == 0.0 and out[2] == 1.0
    # greedy: the bias moves the argmax (3 -> 0) exactly as the biased logits say
    assert (
        choose(build_chain(SamplingParams(logit_bias={3: -3.0}), [EOS]), None, view([]).ids, 1, LOGITS) == 0
    )
    assert choose(build_chain(SamplingParams(), [EOS]), None, view([]).ids, 1, LOGITS) == 3  # control


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ({"5": 1, 2: -100}, ((2, -100.0), (5, 1.0))),  # OpenAI's JSON keys are strings
        ([(7, 0.5)], ((7, 0.5),)),
        ({}, None),
        (None, None),
    ],
)
def test_logit_bias_is_stored_as_sorted_id_bias_pairs(given: object, stored: object) -> None:
    params = SamplingParams(logit_bias=given)  # type: ignore[arg-type]
    assert params.logit_bias == stored
    assert SamplingParams(**{**params.__dict__}) == params  # rebuilt from its fields (as budget() does)


@pytest.mark.parametrize(
    ("given", "needle"),
    [
        ({5: 100.5}, "logit_bias[5] must be in [-100, 100]"),
        ({5: float("nan")}, "logit_bias[5] must be in [-100, 100]"),
        ({"a": 1.0}, "logit_bias must be keyed by token ids >= 0"),
        ({-1: 1.0}, "logit_bias must be keyed by token ids >= 0"),
        ("5", "logit_bias must be a mapping"),
    ],
)
def test_a_bad_logit_bias_names_the_entry_and_the_range(given: object, needle: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(logit_bias=given)  # type: ignore[arg-type]
    assert needle in str(info.value)


# -- closed objects -----------------------------------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
    },
    "required": ["name"],
    "$defs": {"Pet": {"type": "object", "properties": {"kind": {"type": "string"}}}},
}


def test_objects_that_list_properties_are_closed_at_every_depth() -> None:
    closed = close_objects(PERSON)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["address"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["properties"]["additionalProperties"] is False  # a property named "properties"
    assert "additionalProperties" not in props  # ... whose map is no schema
    assert closed["$defs"]["Pet"]["additionalProperties"] is False
    assert "additionalProperties" not in PERSON  # the input is not modified


def test_what_a_schema_says_of_extra_keys_and_objects_without_properties_are_kept() -> None:
    open_map = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert close_objects(open_map) == open_map
    patterned = {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}}
    assert close_objects(patterned) == patterned
    assert close_objects({"type": "object"}) == {"type": "object"}  # json_object: any object
    parts = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert close_objects(parts) == parts  # closing each part would forbid the other's keys
    either = close_objects({"anyOf": [{"properties": {"a": {}}}, {"type": "string"}]})
    assert either["anyOf"][0]["additionalProperties"] is False


@pytest.fixture(scope="module")
def compiler() -> ConstraintCompiler:
    return ConstraintCompiler(Tokenizer(tiny_tokenizer(VOCAB)), VOCAB, [EOS])


def _run(compiler: ConstraintCompiler, params: SamplingParams, text: str) -> None:
    """Feed ``text``'s tokens through the request's constraint (raises on a token it does not allow)."""
    tok = Tokenizer(tiny_tokenizer(VOCAB))
    ids = tok.encode(text, add_special_tokens=False)
    constraint = compiler.compile(params)
    assert constraint is not None
    for n in range(len(ids)):
        row = constraint(view(ids[:n]), np.zeros(VOCAB, dtype=np.float32))
        if row[ids[n]] == -np.inf:
            raise ConstraintError(f"token {n} of {text!r} is masked")


def test_a_schema_without_additional_properties_admits_only_its_keys_unless_extra_properties(
    compiler: ConstraintCompiler,
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    extra = '{"a": 1, "b": 2}'
    _run(compiler, SamplingParams(json_schema=schema), '{"a": 1}')  # the listed key: fine
    with pytest.raises(ConstraintError):
        _run(compiler, SamplingParams(json_schema=schema), extra)
    _run(compiler, SamplingParams(json_schema=schema, json_extra_properties=True), extra)  # JSON Schema's
    explicit = {**schema, "additionalProperties": True}
    _run(compiler, SamplingParams(json_schema=explicit), extra)  # a schema that allows them explicitly
