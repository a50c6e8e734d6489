"""Constrained decoding end to end on random-weight models (the worst case: the model wants garbage).

Every sampled output at temperature 1.0 must parse and validate; greedy and speculative decoding too;
eos waits for the constraint; completion ends the request; invalid constraints fail before decoding.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

import onnxgen
from onnxgen import GenerationError, SamplingParams
from onnxgen.bench.constraints import CONSTRAINTS
from onnxgen.bench.prompts import synthetic_prompt
from onnxgen.generation.constraints import Constraint, ConstraintError
from onnxgen.generation.generator import GenerationResult
from onnxgen.generation.speculative import DraftModel, PromptLookup
from onnxgen.llm import LLM
from onnxgen.testing import build_model

FAMILIES = ("genai-dense", "hybrid-genai")
PROMPT = "The quick brown fox"
SEEDS = range(30)
EOS = 0

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "kind": {"enum": ["cat", "dog", 7, None]},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "minItems": 1, "maxItems": 3},
        "flag": {"type": "boolean"},
    },
    "required": ["id", "score", "kind", "owner", "tags", "flag"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{1,4}(\.[A-Z]{1,3}){0,2}"
# Nested lists of small integers: every sentence of this grammar is also a JSON array.
GRAMMAR = r"""
start: list
list: "[" (item ("," item)*)? "]"
item: INT | list
INT: /0|[1-9][0-9]{0,2}/
"""


def valid_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def valid_regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def valid_grammar(text: str) -> None:
    def check(value: object) -> None:
        assert isinstance(value, list), text
        for item in value:
            if isinstance(item, list):
                check(item)
            else:
                assert type(item) is int and 0 <= item < 1000, text

    check(json.loads(text))


CASES: dict[str, tuple[dict[str, Any], Callable[[str], None]]] = {
    "json_schema": ({"json_schema": SCHEMA}, valid_json),
    "regex": ({"regex": REGEX}, valid_regex),
    "grammar": ({"grammar": GRAMMAR}, valid_grammar),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("constrained")
    return {family: build_model(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def llms(model_dirs: dict[str, Path]) -> dict[str, LLM]:
    return {family: onnxgen.load(path, threads=1) for family, path in model_dirs.items()}


def biased(monkeypatch: pytest.MonkeyPatch, llm: LLM, token: int, bias: float) -> list[int]:
    """Add ``bias`` to one token's logits in every forward and decode step; the returned list counts
    them."""
    calls: list[int] = []
    for name in ("forward", "step"):
        inner = getattr(llm.session, name)

        def wrapped(*args: Any, _inner: Any = inner, **kw: Any) -> np.ndarray:
            calls.append(1)
            logits = np.array(_inner(*args, **kw))
            logits[..., token] += bias
            return logits

        monkeypatch.setattr(llm.session, name, wrapped)
    return calls


# -- every output is in the language ----------------------------------------------------------------
@pytest.mark.parametrize("kind", CASES)
def test_sampling_at_temperature_one_always_yields_a_complete_valid_output(
    llms: dict[str, LLM], kind: str
) -> None:
    kw, validate = CASES[kind]
    for seed in SEEDS:
        llm = llms[FAMILIES[seed % 2]]
        result = llm.generate(PROMPT, SamplingParams(max_new_tokens=200, temperature=1.0, seed=seed, **kw))
        assert result.finish_reason == "stop", (seed, result.text)
        validate(result.text)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", CASES)
def test_greedy_decoding_yields_a_complete_valid_output(llms: dict[str, LLM], family: str, kind: str) -> None:
    kw, validate = CASES[kind]
    result = llms[family].generate(PROMPT, SamplingParams(max_new_tokens=200, **kw))
    assert result.finish_reason == "stop"
    validate(result.text)
    assert result.stats["constraint"] == kind
    # each chosen token took a mask, or was the unmasked argmax and the grammar surely allowed it
    assert result.stats["constraint_masks"] + result.stats["constraint_unmasked"] == len(result.token_ids)


def _masked_every_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every greedy choice take the mask: greedy_choice() never tells."""
    monkeypatch.setattr(Constraint, "greedy_choice", lambda self, generated, argmax: None)


def test_greedy_outputs_equal_with_and_without_the_unmasked_argmax_shortcut(
    llms: dict[str, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy choices made without a mask (Constraint.greedy_choice) against masking every token: on the
    random fixtures and on the bundled demo model (whose argmax the grammars often allow), with this
    file's constraints, the benchmark's, and ones that force text (keys, separators, fixed words)."""
    demo = onnxgen.load(threads=1)
    runs = [(llms[f], PROMPT, kw, 120) for f in FAMILIES for kw, _ in CASES.values()]
    runs += [(demo, "Write the records:", kw, 160) for kw, _ in CASES.values()]
    runs += [(demo, "Write the records:", kw, 160) for kw in CONSTRAINTS.values()]
    runs += [(demo, "def parse(line):", {"regex": r"[a-z_ ()=:.\n]{60,200}"}, 120)]
    runs += [(demo, "Write the records:", {"regex": r"(( the [a-z]{1,8})+\. then [0-9]{1,3}\.)+"}, 120)]
    # the bench's 512-token prompt: the model repeats an 8-letter word, a space is forced after each
    runs += [(demo, synthetic_prompt(512, demo.session.vocab_size), CONSTRAINTS["regex"], 64)]

    def generate() -> list[GenerationResult]:
        return [
            llm.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True, **kw))
            for llm, prompt, kw, n in runs
        ]

    fast = generate()
    with monkeypatch.context() as m:
        _masked_every_token(m)
        slow = generate()
    for a, b in zip(fast, slow, strict=True):
        assert a.token_ids == b.token_ids
        assert b.stats["constraint_unmasked"] == 0
        assert a.stats["constraint_masks"] + a.stats["constraint_unmasked"] == len(a.token_ids)
    unmasked = sum(r.stats["constraint_unmasked"] for r in fast)
    assert unmasked > sum(len(r.token_ids) for r in fast) // 3  # the shortcut was taken, often


def test_sampling_with_top_k_top_p_and_penalties_stays_in_the_language(llms: dict[str, LLM]) -> None:
    for seed in range(8):
        params = SamplingParams(
            max_new_tokens=200,
            temperature=1.5,
            top_k=5,
            top_p=0.9,
            repetition_penalty=1.3,
            seed=seed,
            json_schema=SCHEMA,
        )
        result = llms[FAMILIES[seed % 2]].generate(PROMPT, params)
        assert result.finish_reason == "stop"
        valid_json(result.text)


def test_streamed_text_joins_to_the_valid_output(llms: dict[str, LLM]) -> None:
    params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=3, json_schema=SCHEMA)
    events = list(llms["hybrid-genai"].stream(PROMPT, params))
    valid_json("".join(event.text for event in events))
    assert events[-1].finish_reason == "stop"


# -- speculative decoding verifies drafts against the constraint ---------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_decoding_with_a_constraint_equals_plain_constrained_decoding(
    llms: dict[str, LLM], family: str
) -> None:
    llm = llms[family]
    proposed = 0
    for kw, _ in CASES.values():
        params = SamplingParams(max_new_tokens=200, **kw)
        plain = llm.generate(PROMPT, params)
        for speculative in (PromptLookup(num_draft_tokens=3), DraftModel(llm, num_draft_tokens=3)):
            spec = llm.generate(PROMPT, params, speculative=speculative)
            assert spec.token_ids == plain.token_ids
            assert spec.finish_reason == "stop"
            proposed += spec.stats["proposed_draft_tokens"]
    assert proposed > 0  # drafts were verified, not skipped


@pytest.mark.parametrize("kind", CASES)
def test_sampled_speculative_decoding_with_a_constraint_stays_in_the_language(
    llms: dict[str, LLM], model_dirs: dict[str, Path], kind: str
) -> None:
    kw, validate = CASES[kind]
    llm = llms["genai-dense"]
    for seed in range(6):
        speculative = PromptLookup(2) if seed % 2 else DraftModel(model_dirs["genai-dense"], 3)
        params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=seed, **kw)
        result = llm.generate(PROMPT, params, speculative=speculative)
        assert result.finish_reason == "stop"
        validate(result.text)


# -- eos and completion -----------------------------------------------------------------------------
def test_eos_is_suppressed_until_the_constraint_allows_ending(
    llms: dict[str, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = llms["genai-dense"]
    biased(monkeypatch, llm, EOS, 1e4)  # the model now wants to stop at once
    plain = llm.generate(PROMPT, SamplingParams(max_new_tokens=20))
    assert plain.token_ids == [EOS]
    for kw, validate in CASES.values():
        result = llm.generate(PROMPT, SamplingParams(max_new_tokens=200, **kw))
        assert result.finish_reason == "stop"
        validate(result.text)
        assert EOS not in result.token_ids[:-1]  # eos only as the final token, where the output may end


def test_a_complete_constraint_ends_the_request_without_eos(
    llms: dict[str, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = llms["hybrid-genai"]
    biased(monkeypatch, llm, EOS, -1e4)  # the model never wants to stop
    result = llm.generate(
        PROMPT, SamplingParams(max_new_tokens=50, temperature=1.0, seed=0, regex="[0-9]{12}")
    )
    assert result.finish_reason == "stop"
    assert re.fullmatch("[0-9]{12}", result.text)
    assert EOS not in result.token_ids


def test_a_complete_constraint_ends_the_request_even_with_ignore_eos(llms: dict[str, LLM]) -> None:
    params = SamplingParams(max_new_tokens=50, ignore_eos=True, regex="hello world")
    result = llms["genai-dense"].generate(PROMPT, params)
    assert result.finish_reason == "stop"
    assert result.text == "hello world"


def test_running_out_of_tokens_first_reports_length_with_a_valid_prefix(llms: dict[str, LLM]) -> None:
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=1, regex="[a-z]{40}")
    result = llms["genai-dense"].generate(PROMPT, params)
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 5
    assert re.fullmatch("[a-z]+", result.text) and len(result.text) < 40


# -- errors before decoding -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        {"json_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
        {"regex": "(unclosed"},
        {"grammar": "start: undefined_rule"},
    ],
)
def test_an_invalid_constraint_fails_before_any_forward(
    llms: dict[str, LLM], monkeypatch: pytest.MonkeyPatch, kw: dict[str, Any]
) -> None:
    llm = llms["genai-dense"]
    calls = biased(monkeypatch, llm, EOS, 0.0)
    name = next(iter(kw))
    with pytest.raises(ConstraintError, match=f"{name} does not compile"):
        llm.stream(PROMPT, SamplingParams(**kw))
    assert calls == []


def test_a_model_without_a_tokenizer_refuses_a_constraint(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(model_dirs["genai-dense"], bare)
    (bare / "tokenizer.json").unlink()
    (bare / "tokenizer_config.json").unlink()
    llm = onnxgen.load(bare, threads=1)
    with pytest.raises(GenerationError, match=r"regex .*tokenizer\.json"):
        llm.generate([5, 17, 200], SamplingParams(regex="[0-9]+"))
