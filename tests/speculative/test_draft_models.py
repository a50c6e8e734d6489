"""Choosing a draft model: by LLM or by directory; a draft with another tokenizer is refused clearly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from speculative_helpers import PROMPT, ModelZoo, greedy

import onnxgen
from onnxgen import DraftModel, GenerationError, PromptLookup, SamplingParams
from onnxgen.testing import TinySpec

FAMILY = "genai-dense"


def test_a_draft_model_given_as_a_directory_is_loaded_and_drafts_like_the_same_llm(zoo: ModelZoo) -> None:
    llm = zoo.llm(FAMILY)
    plain = greedy(llm, PROMPT, 16)
    result = llm.generate(
        PROMPT, SamplingParams(max_new_tokens=16), speculative=DraftModel(str(zoo.dir(FAMILY)))
    )
    assert result.token_ids == plain.token_ids
    assert result.stats["accepted_draft_tokens"] == result.stats["proposed_draft_tokens"] > 0


def test_a_draft_directory_gets_the_cores_its_target_leaves(
    zoo: ModelZoo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two thread pools that take turns on the same cores make both wait (each spins after its runs)."""
    monkeypatch.setattr(onnxgen.llm, "default_threads", lambda: 8)
    assert [onnxgen.llm.draft_threads(t) for t in (8, 6, 1, 12)] == [1, 3, 8, 1]
    target = onnxgen.load(zoo.dir(FAMILY), threads=6)
    target.generate(PROMPT, SamplingParams(max_new_tokens=2), speculative=DraftModel(str(zoo.dir(FAMILY))))
    (draft,) = target._drafts.values()
    assert draft.session.threads == 3
    assert draft.session.session.get_session_options().intra_op_num_threads == 3


def test_a_draft_model_with_another_vocabulary_size_is_refused_before_generating(zoo: ModelZoo) -> None:
    llm = zoo.llm(FAMILY)
    other = zoo.llm(FAMILY, spec=TinySpec(vocab_size=300))
    with pytest.raises(GenerationError, match=r"vocabulary of 300 logits but the target has 320.*tokenizer"):
        llm.generate(PROMPT, SamplingParams(max_new_tokens=4), speculative=DraftModel(other))
    with pytest.raises(GenerationError, match="vocabulary"):
        list(llm.stream(PROMPT, SamplingParams(max_new_tokens=4), speculative=DraftModel(other)))


def test_a_draft_model_whose_tokenizer_encodes_differently_is_refused(zoo: ModelZoo, tmp_path: Path) -> None:
    # Same vocabulary size, but two byte tokens swap ids: the draft's ids would mean other text.
    llm = zoo.llm(FAMILY)
    draft_dir = tmp_path / "swapped"
    shutil.copytree(zoo.dir(FAMILY), draft_dir)
    tok_path = draft_dir / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["e"] = vocab["e"], vocab["a"]
    tok_path.write_text(json.dumps(tok))
    draft = onnxgen.load(draft_dir, threads=1)
    assert draft.tokenizer is not None and draft.tokenizer.encode("ae") != llm.tokenizer.encode("ae")  # type: ignore[union-attr]
    with pytest.raises(GenerationError, match=f"{draft_dir}.*tokenizes text differently"):
        llm.generate(PROMPT, SamplingParams(max_new_tokens=4), speculative=DraftModel(draft))


def test_prompt_lookup_needs_no_draft_model_and_a_draft_model_needs_its_loaded_model(zoo: ModelZoo) -> None:
    llm = zoo.llm(FAMILY)
    assert llm.generate(PROMPT, SamplingParams(max_new_tokens=4), speculative=PromptLookup()).token_ids
    with pytest.raises(GenerationError, match="loaded draft model"):
        llm.generator.generate(PROMPT, SamplingParams(max_new_tokens=4), DraftModel(llm), None)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (lambda: PromptLookup(num_draft_tokens=0), "num_draft_tokens must be an integer >= 1"),
        (lambda: PromptLookup(min_ngram=3, max_ngram=2), "1 <= min_ngram <= max_ngram"),
        (lambda: DraftModel("x", num_draft_tokens=True), "num_draft_tokens"),
    ],
)
def test_speculative_configs_reject_bad_values_with_the_parameter_named(config: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        config()  # type: ignore[operator]


def test_a_draft_model_with_a_shorter_context_stops_drafting_instead_of_failing(zoo: ModelZoo) -> None:
    llm = zoo.llm(FAMILY)
    draft = zoo.llm(FAMILY, spec=TinySpec(max_position=32))
    assert draft.package.context_length == 32
    plain = greedy(llm, PROMPT, 48)
    result = llm.generate(PROMPT, SamplingParams(max_new_tokens=48), speculative=DraftModel(draft))
    assert result.token_ids == plain.token_ids
