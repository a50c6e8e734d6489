"""Constraint parameters, response_format mapping, and the Constraint processor on synthetic logits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from onnxgen.errors import GenerationError
from onnxgen.generation.constraints import (
    ConstraintCompiler,
    ConstraintError,
    check_constraint,
    constraint_from_response_format,
)
from onnxgen.generation.params import SamplingParams, SamplingParamsError
from onnxgen.generation.processors import SequenceView, apply_chain, build_chain, choose
from onnxgen.testing import tiny_tokenizer
from onnxgen.tokenizer import Tokenizer

VOCAB = 320
EOS = 0


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(tiny_tokenizer(VOCAB))


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> ConstraintCompiler:
    return ConstraintCompiler(tok, VOCAB, [EOS])


def gen(ids: list[int]) -> SequenceView:
    """A view with a two-token prompt and ``ids`` generated."""
    return SequenceView(np.array([5, 6, *ids], dtype=np.int64), 2)


def live(row: np.ndarray) -> set[int]:
    return {int(i) for i in np.flatnonzero(row != -np.inf)}


def prefix_tokens(tok: Tokenizer, text: str, done: str = "") -> set[int]:
    """Ids whose text extends ``done`` to a longer prefix of ``text`` (an oracle independent of llguidance)."""
    out = set()
    for i in range(VOCAB):
        piece = tok.decode([i], skip_special_tokens=False)
        if piece and text.startswith(done + piece) and not piece.startswith("<|"):
            out.add(i)
    return out


# -- SamplingParams ---------------------------------------------------------------------------------
def test_a_json_schema_dict_is_stored_as_json_text_that_parses_back_to_it() -> None:
    schema = {"type": "object", "properties": {"a": {"enum": [1, "x", None]}}}
    params = SamplingParams(json_schema=schema)
    assert isinstance(params.json_schema, str)
    assert json.loads(params.json_schema) == schema
    assert params.constraint == "json_schema"
    assert SamplingParams(json_schema=json.dumps(schema)).json_schema == params.json_schema


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", 3, ["type"], {"x": {1, 2}}])
def test_a_json_schema_that_is_not_a_json_object_is_refused_by_name(bad: object) -> None:
    with pytest.raises(SamplingParamsError, match="json_schema must be"):
        SamplingParams(json_schema=bad)  # type: ignore[arg-type]


def test_two_constraints_at_once_are_refused_naming_both() -> None:
    with pytest.raises(SamplingParamsError, match="one at a time") as info:
        SamplingParams(regex="a+", grammar="start: 'a'")
    assert "regex, grammar" in str(info.value)
    with pytest.raises(ValueError, match="json_schema, regex"):
        SamplingParams(json_schema={"type": "object"}, regex="a")


@pytest.mark.parametrize("name", ["regex", "grammar"])
@pytest.mark.parametrize("bad", ["", 7])
def test_an_empty_or_non_text_regex_or_grammar_is_refused(name: str, bad: object) -> None:
    with pytest.raises(SamplingParamsError, match=f"{name} must be a non-empty string"):
        SamplingParams(**{name: bad})  # type: ignore[arg-type]


def test_params_without_a_constraint_report_none() -> None:
    assert SamplingParams().constraint is None
    assert SamplingParams(regex="[0-9]+").constraint == "regex"


# -- response_format --------------------------------------------------------------------------------
def test_response_format_text_or_none_maps_to_no_constraint() -> None:
    assert constraint_from_response_format(None) == {}
    assert constraint_from_response_format({"type": "text"}) == {}


def test_response_format_json_object_maps_to_any_json_object() -> None:
    params = SamplingParams(**constraint_from_response_format({"type": "json_object"}))
    assert json.loads(str(params.json_schema)) == {"type": "object"}


def test_response_format_json_schema_maps_to_its_schema() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    kw = constraint_from_response_format(
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    )
    assert kw == {"json_schema": schema}
    assert constraint_from_response_format({"type": "json_schema", "json_schema": {"name": "x"}}) == {
        "json_schema": {}
    }


@pytest.mark.parametrize(
    ("response_format", "needle"),
    [
        ({"type": "xml"}, "response_format.type"),
        ({}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": "nope"}, "response_format.json_schema"),
        ("json_object", "response_format must be an object"),
    ],
)
def test_a_malformed_response_format_is_refused_by_name(response_format: object, needle: str) -> None:
    with pytest.raises(SamplingParamsError, match=needle):
        constraint_from_response_format(response_format)  # type: ignore[arg-type]


# -- compiling --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"regex": "[a-"}, "unclosed character class"),
        ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 3}}, "minimum"),
        ({"json_schema": {"$ref": "#/defs/missing"}}, "does not exist"),
        ({"grammar": 'start: "a" missing_rule'}, "missing_rule"),
    ],
)
def test_an_invalid_constraint_is_refused_with_the_compilers_message(
    compiler: ConstraintCompiler, kw: dict[str, object], needle: str
) -> None:
    params = SamplingParams(**kw)  # type: ignore[arg-type]
    name = next(iter(kw))
    for compile_it in (check_constraint, compiler.compile):
        with pytest.raises(ConstraintError, match=f"{name} does not compile") as info:
            compile_it(params)
        assert needle in str(info.value)
        assert "\n" not in str(info.value)
        assert isinstance(info.value, ValueError) and isinstance(info.value, GenerationError)


OPTIONAL_PROPERTIES = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(500)}}


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({"$ref": "#"}, "admits no finite output"),
        ({"anyOf": [{"$ref": "#"}]}, "admits no finite output"),
        (OPTIONAL_PROPERTIES, "too many alternatives"),
    ],
)
def test_a_schema_that_compiles_but_fails_its_first_steps_is_refused_at_compile_time(
    compiler: ConstraintCompiler, schema: dict[str, object], needle: str
) -> None:
    # the permissive reading: 500 optional properties, each key allowed again as an extra one
    params = SamplingParams(json_schema=schema, json_extra_properties=True)
    check_constraint(params)  # llguidance's own validation passes these: only running them shows it
    with pytest.raises(ConstraintError, match="json_schema cannot constrain the output") as info:
        compiler.compile(params)
    assert needle in str(info.value) and "<state>" not in str(info.value) and "\n" not in str(info.value)
    required = {**OPTIONAL_PROPERTIES, "required": list(OPTIONAL_PROPERTIES["properties"])}  # type: ignore[call-overload]
    assert compiler.compile(SamplingParams(json_schema=required, json_extra_properties=True)) is not None


def test_a_parser_limit_hit_in_the_middle_of_the_output_is_reported_as_such(
    compiler: ConstraintCompiler, tok: Tokenizer
) -> None:
    free = {f"s{i}": {"type": "string"} for i in range(6)}
    schema = {"type": "object", "properties": {**free, "b": OPTIONAL_PROPERTIES}}
    permissive = SamplingParams(json_schema={**schema, "required": [*free, "b"]}, json_extra_properties=True)
    constraint = compiler.compile(permissive)
    assert constraint is not None  # the limit is past six free choices: further than the probe looks
    text = "{" + "".join(f'"s{i}": "x", ' for i in range(6)) + '"b": {'
    ids = np.array(tok.encode(text, add_special_tokens=False), dtype=np.int64)
    with pytest.raises(ConstraintError, match="too many alternatives") as info:
        for n in range(1, len(ids) + 1):
            constraint(gen(list(ids[: n - 1])), np.zeros(VOCAB, dtype=np.float32))
            constraint.complete(ids[:n])
    assert "outside the json_schema constraint" not in str(info.value)


def test_a_parser_limit_after_a_free_choice_is_found_before_decoding(compiler: ConstraintCompiler) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": OPTIONAL_PROPERTIES}}
    with pytest.raises(ConstraintError, match="too many alternatives"):  # (the permissive reading)
        compiler.compile(
            SamplingParams(json_schema={**schema, "required": ["a", "b"]}, json_extra_properties=True)
        )


def test_a_valid_constraint_passes_the_check_and_params_without_one_compile_to_none(
    compiler: ConstraintCompiler,
) -> None:
    check_constraint(SamplingParams(regex="[0-9]{2}"))
    check_constraint(SamplingParams())
    assert compiler.compile(SamplingParams()) is None


def test_a_constraint_needs_a_tokenizer() -> None:
    with pytest.raises(GenerationError, match=r"tokenizer\.json"):
        ConstraintCompiler(None, VOCAB, [EOS]).compile(SamplingParams(regex="a"))


# -- masking ----------------------------------------------------------------------------------------
def test_the_mask_keeps_exactly_the_tokens_that_continue_the_language(
    compiler: ConstraintCompiler, tok: Tokenizer
) -> None:
    constraint = compiler.compile(SamplingParams(regex="the cat"))
    assert constraint is not None
    logits = np.linspace(-3.0, 3.0, VOCAB, dtype=np.float32)
    logits[EOS] = 100.0
    canonical = tok.encode("the cat")  # t|he|Ġc|at
    out = constraint(gen([]), logits)
    assert live(out) == prefix_tokens(tok, "the cat")
    assert np.array_equal(out[sorted(live(out))], logits[sorted(live(out))])  # kept logits are untouched
    assert logits[EOS] == 100.0  # out of place
    out = constraint(gen(canonical[:2]), logits)
    # Where the next bytes are forced, llguidance may drop tokenizations the tokenizer never makes (Ġ|c).
    assert canonical[2] in live(out)
    assert live(out) <= prefix_tokens(tok, "the cat", "the")


def test_eos_is_masked_until_the_constraint_may_end_and_then_it_may_end(
    compiler: ConstraintCompiler, tok: Tokenizer
) -> None:
    constraint = compiler.compile(SamplingParams(regex="[0-9]{1,3}"))
    assert constraint is not None
    logits = np.zeros(VOCAB, dtype=np.float32)
    assert EOS not in live(constraint(gen([]), logits))
    seven = tok.encode("7")
    assert not constraint.complete(np.array(seven))
    after = live(constraint(gen(seven), logits))
    assert EOS in after and tok.token_to_id("8") in after
    assert constraint.complete(np.array([*seven, EOS]))


def test_a_constraint_is_complete_when_nothing_but_eos_may_follow(
    compiler: ConstraintCompiler, tok: Tokenizer
) -> None:
    constraint = compiler.compile(SamplingParams(regex="ab"))
    assert constraint is not None
    ids = [tok.token_to_id("a"), tok.token_to_id("b")]
    assert not constraint.complete(np.array(ids[:1]))
    assert constraint.complete(np.array(ids))
    assert live(constraint(gen(ids), np.zeros(VOCAB, dtype=np.float32))) == {EOS}


def test_the_constraint_follows_a_sequence_that_goes_back_and_changes(
    compiler: ConstraintCompiler, tok: Tokenizer
) -> None:
    constraint = compiler.compile(SamplingParams(regex="(ab|ac)d"))
    assert constraint is not None
    a, b, c, d = (tok.token_to_id(x) for x in "abcd")
    logits = np.zeros(VOCAB, dtype=np.float32)
    first = live(constraint(gen([]), logits))
    assert live(constraint(gen([a, b]), logits)) == {d}
    assert live(constraint(gen([]), logits)) == first  # rolled back to the start
    assert live(constraint(gen([a]), logits)) == {b, c}
    assert live(constraint(gen([a, c]), logits)) == {d}  # b replaced by c


def test_a_prefix_outside_the_language_is_passed_through_and_refused_when_emitted(
    compiler: ConstraintCompiler, tok: Tokenizer
) -> None:
    constraint = compiler.compile(SamplingParams(regex="ab"))
    assert constraint is not None
    z = tok.token_to_id("z")
    logits = np.arange(VOCAB, dtype=np.float32)
    assert np.array_equal(constraint(gen([z]), logits), logits)
    with pytest.raises(GenerationError, match=f"token {z} .*outside the regex constraint"):
        constraint.complete(np.array([z]))
    assert live(constraint(gen([]), logits)) == prefix_tokens(tok, "ab")  # still usable


def test_logits_wider_than_the_token_table_never_allow_the_extra_ids(compiler: ConstraintCompiler) -> None:
    constraint = compiler.compile(SamplingParams(json_schema={"type": "string"}))
    assert constraint is not None
    out = constraint(gen([]), np.zeros(VOCAB + 40, dtype=np.float32))
    assert out.shape == (VOCAB + 40,)
    assert live(out) and max(live(out)) < VOCAB


def test_a_dense_mask_keeps_every_allowed_token(compiler: ConstraintCompiler, tok: Tokenizer) -> None:
    constraint = compiler.compile(SamplingParams(json_schema={"type": "string"}))
    assert constraint is not None
    quote = tok.token_to_id('"')
    out = constraint(gen([quote]), np.zeros(VOCAB, dtype=np.float32))
    assert len(live(out)) > VOCAB // 2  # inside a string almost anything goes
    assert tok.token_to_id("x") in live(out) and EOS not in live(out)


def test_a_constraint_masks_one_sequence_only(compiler: ConstraintCompiler) -> None:
    constraint = compiler.compile(SamplingParams(regex="a"))
    assert constraint is not None
    with pytest.raises(ValueError, match="its own Constraint"):
        constraint([gen([]), gen([])], np.zeros((2, VOCAB), dtype=np.float32))


def test_the_constraint_masks_before_top_k_so_top_k_keeps_the_best_allowed_token(
    compiler: ConstraintCompiler, tok: Tokenizer
) -> None:
    constraint = compiler.compile(SamplingParams(regex="[xy]"))
    assert constraint is not None
    x, y = tok.token_to_id("x"), tok.token_to_id("y")
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits[tok.token_to_id("q")] = 9.0  # the model's favourite is not allowed
    logits[y] = 2.0
    logits[x] = 1.0
    params = SamplingParams(temperature=0.7, top_k=1)
    out = apply_chain(build_chain(params, [EOS], constraint), gen([]), logits)
    assert live(out) == {y}
    greedy = apply_chain(build_chain(SamplingParams(), [EOS], constraint), gen([]), logits)
    assert int(np.argmax(greedy)) == y


def test_two_requests_with_the_same_constraint_keep_separate_states(
    compiler: ConstraintCompiler, tok: Tokenizer
) -> None:
    params = SamplingParams(regex="(ab|ac)d")
    first, second = compiler.compile(params), compiler.compile(params)
    assert first is not None and second is not None
    a, b = tok.token_to_id("a"), tok.token_to_id("b")
    logits = np.zeros(VOCAB, dtype=np.float32)
    assert not first.complete(np.array([a, b]))
    assert live(second(gen([]), logits)) == {a}  # the second one has not moved
    assert live(first(gen([a, b]), logits)) == {tok.token_to_id("d")}


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("width", [VOCAB - 7, VOCAB, VOCAB + 40])
def test_the_mask_keeps_allowed_logits_exactly_and_sets_the_rest_to_minus_inf(
    compiler: ConstraintCompiler, tok: Tokenizer, dtype: type, width: int
) -> None:
    """The additive mask against the regex's own oracle: allowed logits unchanged bit for bit (including
    negative zero and huge values), every other id -inf, for any dtype and for rows narrower or wider
    than the token table; the mask follows the grammar as tokens are generated."""
    constraint = compiler.compile(SamplingParams(regex="abc|abd|xyz"))
    assert constraint is not None
    logits = np.random.default_rng(0).normal(size=width).astype(dtype) * 1000
    logits[tok.token_to_id("a")] = -0.0
    for done in ("", "a", "ab"):
        ids = [tok.token_to_id(c) for c in done]
        out = constraint(gen(ids), logits)
        assert out.dtype == logits.dtype and out.shape == logits.shape
        allowed = (
            prefix_tokens(tok, "abc", done)
            | prefix_tokens(tok, "abd", done)
            | prefix_tokens(tok, "xyz", done)
        )
        allowed = {i for i in allowed if i < width}
        assert live(out) == allowed
        keep = sorted(allowed)
        assert out[keep].tobytes() == logits[keep].tobytes()


# -- greedy choices without a mask: Constraint.greedy_choice and choose ------------------------------
def test_where_forced_text_makes_a_whole_token_the_choice_is_that_token_alone(
    compiler: ConstraintCompiler, tok: Tokenizer
) -> None:
    """Where the grammar forces ' the ' the mask holds the canonical ' the' alone, though the grammar
    would take shorter pieces of it (' ', ' t', ' th'): keeping an argmax because the grammar takes it
    would be wrong here."""
    constraint = compiler.compile(SamplingParams(regex=r" the [a-z]+"))
    assert constraint is not None
    view = gen([])
    mask = live(constraint(view, np.zeros(VOCAB, np.float32)))
    takes = {t for t in range(VOCAB) if constraint._matcher.validate_tokens([t]) == 1}
    assert {tok.decode([t]) for t in mask} == {" the"}
    assert takes - mask, "the negative control needs tokens the grammar takes that its mask refuses"
    assert {constraint.greedy_choice(view.generated, t) for t in takes} == mask


@pytest.mark.parametrize(
    "kw",
    [
        {"regex": r"[a-z]{1,8}( [a-z]{1,8}){3,9}"},
        {"regex": r"(the|they|then) [0-9]{2,5}\.[0-9]+( the [a-z]{1,4})*"},
        {
            "json_schema": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "n": {"type": "number"}},
            }
        },
        {"grammar": 'start: expr\nexpr: NAME | NAME " = " expr | "(" expr ")"\nNAME: /[a-z]{1,5}/'},
        # forcing off: the mask holds every piece of forced text, not the canonical token alone
        {
            "grammar": '%llguidance {"no_forcing": true}\nstart: " the " NAME " then " NAME\nNAME: /[a-z]{1,5}/'
        },
    ],
    ids=["words", "forced-words", "json", "grammar", "no-forcing"],
)
def test_greedy_choice_is_the_masked_argmax_for_every_argmax_and_leaves_the_state_after_it(
    compiler: ConstraintCompiler, kw: dict
) -> None:
    """Random walks through the language; at every state and for every unmasked argmax a, greedy_choice
    answers None, or a with a in the mask, or c with the mask {c} alone: each is the masked argmax of any
    logits whose argmax is a. The grammar state it leaves is the one after its token."""
    rng = np.random.default_rng(3)
    told = untold = 0
    for _ in range(3):
        constraint = compiler.compile(SamplingParams(**kw))
        assert constraint is not None
        ids: list[int] = []
        for _ in range(30):
            view = gen(ids)
            mask = live(constraint(view, np.zeros(VOCAB, np.float32)))
            if not mask - {EOS}:
                break
            choices = {a: constraint.greedy_choice(view.generated, a) for a in range(VOCAB)}
            for a, c in choices.items():
                assert c is None or (c == a and a in mask) or mask == {c}, (a, c, mask)
            told += sum(c is not None for c in choices.values())
            untold += sum(c is None for c in choices.values())
            picked = [c for c in choices.values() if c is not None]
            if picked:  # the state greedy_choice leaves behind is the one after its token
                a = next(a for a, c in choices.items() if c is not None)
                c = constraint.greedy_choice(view.generated, a)
                assert c is not None
                fresh = compiler.compile(SamplingParams(**kw))
                assert fresh is not None
                nxt = np.zeros(VOCAB, np.float32)
                assert live(constraint(gen([*ids, c]), nxt)) == live(fresh(gen([*ids, c]), nxt))
            ids.append(int(rng.choice(sorted(mask - {EOS}))))
    assert told > 0 and untold > 0  # both answers happened


def test_greedy_choose_with_a_constraint_equals_the_argmax_of_the_masked_chain(
    compiler: ConstraintCompiler,
) -> None:
    """choose() skips the mask where greedy_choice can tell; its token must be the argmax after the full
    chain (penalties, then the mask) every time, ties included, with or without a mask."""
    rng = np.random.default_rng(11)
    params = SamplingParams(regex=r"([a-z ]{3,8}, then ){4,6}[a-z]{2,5}\.", repetition_penalty=1.3)
    shortcut, masked = compiler.compile(params), compiler.compile(params)
    assert shortcut is not None and masked is not None
    chain, full = build_chain(params, [EOS], shortcut), build_chain(params, [EOS], masked)
    ids = [5, 6]
    for step in range(36):
        logits = rng.standard_normal(VOCAB).astype(np.float32)
        if step % 3 == 0:  # the model prefers letters: the shortcut has something to take
            logits[ord("a") - 30 : ord("z") - 29] += 4.0
        if step % 5 == 0:  # exact ties: the lowest id must win on both paths
            logits[[70, 71, 72]] = logits.max() + 1.0
        expected = int(np.argmax(apply_chain(full, SequenceView(np.array(ids), 2), logits)))
        token = choose(chain, None, np.array(ids), 2, logits)
        assert token == expected, step
        ids.append(token)
        if shortcut.complete(np.array(ids[2:])) | masked.complete(np.array(ids[2:])):
            break
    assert len(ids) > 20
    assert shortcut.shortcuts > 0 and shortcut.masks > 0
    assert masked.shortcuts == 0
