"""The tiny models' byte-level BPE tokenizer and its chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from onnxgen.testing import SPECIAL_TOKENS, TinySpec, build_model, special_token_ids, tiny_tokenizer
from onnxgen.testing import tokenizer as tokmod

TEXTS = [
    "Hello, world! How are you today?",
    "def main() -> int:\n    return 42  # done\n",
    "Ünïcödé — naïve café, 日本語, emoji 🙂 and tabs\tand  double  spaces.",
    "",
]


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("tok"), "standard-dense", TinySpec())


@pytest.mark.parametrize("vocab_size", [259, 320, 777, 4000])
def test_vocabulary_has_exactly_the_spec_size(vocab_size: int) -> None:
    tok = tiny_tokenizer(vocab_size)
    assert tok.get_vocab_size() == vocab_size
    assert max(tok.get_vocab().values()) == vocab_size - 1


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips_through_encode_and_decode(text: str) -> None:
    tok = tiny_tokenizer(320)
    ids = tok.encode(text).ids
    assert all(0 <= i < 320 for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_common_words_are_merged_into_fewer_tokens_than_bytes() -> None:
    text = "the quick brown fox and the lazy dog"
    assert len(tiny_tokenizer(320).encode(text).ids) < 0.7 * len(text.encode())


def test_special_tokens_are_single_ids_and_never_split() -> None:
    tok = tiny_tokenizer(320)
    ids = special_token_ids(320)
    assert ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    encoded = tok.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>").ids
    assert encoded[0] == 1 and encoded[-2:] == [2, 0]
    assert tok.decode(encoded, skip_special_tokens=True) == "user\nhi"


def test_training_is_deterministic() -> None:
    first = tiny_tokenizer(333).to_str()
    tokmod._trained_json.cache_clear()
    assert tiny_tokenizer(333).to_str() == first


def test_too_small_a_vocabulary_is_rejected_naming_vocab_size() -> None:
    with pytest.raises(ValueError, match="vocab_size=100"):
        tiny_tokenizer(100)


def test_package_tokenizer_json_loads_and_matches_the_in_memory_tokenizer(package: Path) -> None:
    tok = Tokenizer.from_file(str(package / "tokenizer.json"))
    assert tok.encode(TEXTS[0]).ids == tiny_tokenizer(320).encode(TEXTS[0]).ids


def test_tokenizer_config_names_eos_no_bos_and_the_context_length(package: Path) -> None:
    cfg = json.loads((package / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|endoftext|>" and cfg["bos_token"] is None
    assert cfg["model_max_length"] == TinySpec().max_position
    assert [cfg["added_tokens_decoder"][str(i)]["content"] for i in range(3)] == list(SPECIAL_TOKENS)


def test_chat_template_renders_chatml_that_tokenizes_to_the_specials(package: Path) -> None:
    cfg = json.loads((package / "tokenizer_config.json").read_text())
    env = ImmutableSandboxedEnvironment()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = env.from_string(cfg["chat_template"]).render(messages=messages, add_generation_prompt=True)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tiny_tokenizer(320).encode(text).ids
    assert ids.count(1) == 3 and ids.count(2) == 2
