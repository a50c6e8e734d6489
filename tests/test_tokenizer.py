from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from onnxgen.errors import TokenizerError
from onnxgen.tokenizer import IncrementalDetokenizer, Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "héllo wörld — 日本語 🙂",
    "hello world, hello there",
    "the quick brown fox jumps over the lazy dog",
]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🙂"}]


def byte_level_bpe() -> HFTokenizer:
    """A GPT-2 style byte-level BPE small enough that multi-byte characters stay split over byte tokens."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 20, trainer)
    return backend


def metaspace_bpe() -> HFTokenizer:
    """A SentencePiece-like tokenizer: its decoder drops the leading space of the first token."""
    backend = HFTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    backend.train_from_iterator(["Hello world, hello there world"] * 10, trainer)
    return backend


def write_dir(tmp_path: Path, config: dict[str, Any] | None = None, template_file: str | None = None) -> Path:
    byte_level_bpe().save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if template_file is not None:
        (tmp_path / "chat_template.jinja").write_text(template_file, encoding="utf-8")
    return tmp_path


@pytest.fixture
def tok(tmp_path: Path) -> Tokenizer:
    config = {"eos_token": {"content": "<|im_end|>", "special": True}, "chat_template": CHATML}
    return Tokenizer.from_dir(write_dir(tmp_path, config))


def test_a_directory_without_tokenizer_json_is_refused_with_its_path(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json not found.*save_pretrained"):
        Tokenizer.from_dir(tmp_path)


def test_a_malformed_tokenizer_config_names_the_file(tmp_path: Path) -> None:
    write_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json cannot be read"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", [*CORPUS, "", " leading and trailing  "])
def test_encode_then_decode_gives_the_text_back(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_and_vocabulary_come_from_the_files(tok: Tokenizer) -> None:
    assert tok.vocab_size == 300
    assert tok.token_to_id("<|im_start|>") == 1
    assert tok.token_to_id("no such token") is None
    assert tok.eos_token_id == 2
    assert tok.eos_token_ids == (2,)
    assert tok.bos_token_id is None


def test_decode_skips_special_tokens_unless_asked_not_to(tok: Tokenizer) -> None:
    ids = [1, *tok.encode("hello"), 2]
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"


def test_add_bos_token_prepends_bos_only_with_special_tokens(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(write_dir(tmp_path, {"bos_token": "<|endoftext|>", "add_bos_token": True}))
    assert tok.encode("hello")[0] == 0
    assert tok.encode("hello", add_special_tokens=False)[0] != 0
    assert tok.encode("hello")[1:] == tok.encode("hello", add_special_tokens=False)


def test_the_chat_template_renders_chatml_with_a_generation_prompt(tok: Tokenizer) -> None:
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhéllo 🙂<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(MESSAGES) == expected
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == expected.removesuffix(
        "<|im_start|>assistant\n"
    )


def test_encode_chat_adds_no_special_tokens_of_its_own(tok: Tokenizer) -> None:
    ids = tok.encode_chat(MESSAGES)
    assert ids[0] == 1 and ids.count(2) == 2
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(MESSAGES)


def test_a_chat_template_jinja_file_wins_over_the_config(tmp_path: Path) -> None:
    config = {"chat_template": "from config"}
    tok = Tokenizer.from_dir(write_dir(tmp_path, config, template_file="from file"))
    assert tok.apply_chat_template(MESSAGES) == "from file"


def test_a_named_template_list_in_the_config_uses_the_default_entry(tmp_path: Path) -> None:
    config = {
        "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    }
    assert Tokenizer.from_dir(write_dir(tmp_path, config)).apply_chat_template(MESSAGES) == "plain"


def test_a_missing_chat_template_names_the_files_looked_at_and_the_fix(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(write_dir(tmp_path, {"eos_token": "<|im_end|>"}))
    with pytest.raises(TokenizerError) as info:
        tok.apply_chat_template(MESSAGES)
    message = str(info.value)
    assert str(tmp_path / "chat_template.jinja") in message
    assert str(tmp_path / "tokenizer_config.json") in message
    assert "add a chat_template.jinja file" in message


def render(tmp_path: Path, template: str, messages: list[dict[str, Any]] = MESSAGES, **kwargs: Any) -> str:
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    return Tokenizer.from_dir(write_dir(tmp_path, config, template)).apply_chat_template(messages, **kwargs)


def test_templates_see_the_hf_globals(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ tools }}|{{ add_generation_prompt }}|{{ messages | length }}"
    )
    assert render(tmp_path, template) == "<|endoftext|>|<|im_end|>|None|True|2"


def test_extra_keyword_arguments_reach_the_template(tmp_path: Path) -> None:
    assert render(tmp_path, "{{ enable_thinking }}", enable_thinking=False) == "False"


def test_tojson_keeps_non_ascii_text_readable(tmp_path: Path) -> None:
    tools = [{"name": "wörld", "n": 1}]
    assert render(tmp_path, "{{ tools | tojson }}", tools=tools) == '[{"name": "wörld", "n": 1}]'


def test_blocks_are_trimmed_the_way_hf_renders_them(tmp_path: Path) -> None:
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert render(tmp_path, template) == "héllo 🙂\n"


def test_raise_exception_in_a_template_becomes_a_tokenizer_error(tmp_path: Path) -> None:
    template = (
        "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    )
    with pytest.raises(TokenizerError, match="rejected the messages: System role not supported"):
        render(tmp_path, template)


def test_content_the_template_cannot_handle_becomes_a_tokenizer_error(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with pytest.raises(TokenizerError, match="rejected the messages"):
        render(tmp_path, CHATML, messages)


def test_generation_blocks_render_their_body(tmp_path: Path) -> None:
    assert render(tmp_path, "a{% generation %}b{% endgeneration %}c") == "abc"


def test_none_valued_message_keys_are_dropped(tmp_path: Path) -> None:
    messages = [{"role": "assistant", "content": "hi", "tool_calls": None}]
    assert render(tmp_path, "{{ 'tool_calls' in messages[0] }}", messages) == "False"


def test_a_message_that_is_not_a_mapping_is_refused_by_index(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="chat message 1 must be a mapping"):
        render(tmp_path, "x", [{"role": "user", "content": "hi"}, "hello"])  # type: ignore[list-item]


def test_the_sandbox_refuses_dunder_attribute_chains(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="rejected"):
        render(tmp_path, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    assert render(tmp_path, "{{ ''.__class__ }}") == ""


def test_the_sandbox_refuses_to_mutate_the_messages(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TokenizerError, match="unsafe"):
        render(tmp_path, "{{ messages.append({'role': 'x'}) }}", messages)
    with pytest.raises(TokenizerError, match="unsafe"):
        render(tmp_path, "{{ messages[0].update({'content': 'changed'}) }}", messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_a_template_with_a_syntax_error_is_reported(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not compile"):
        render(tmp_path, "{% for m in messages %}")


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.feed(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld — 日本語 🙂",
        "🙂🙂 x 🙂",
        "hello world, hello there",
        "日本語日本語 and — dashes — ",
        " the lazy dog 🙂",
    ],
)
def test_streamed_pieces_concatenate_to_the_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_an_emoji_split_over_byte_tokens_is_held_back_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("a🙂")
    assert len(ids) >= 3, "the test tokenizer must split the emoji over several byte tokens"
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.feed(i) for i in ids]
    assert pieces[0] == "a"
    assert pieces[1:-1] == [""] * (len(ids) - 2)
    assert pieces[-1] == "🙂"


def test_streaming_after_a_prompt_continues_its_text(tok: Tokenizer) -> None:
    prompt, generated = tok.encode("héllo wörld"), tok.encode(" — 日本語 🙂 the end")
    pieces = stream(IncrementalDetokenizer(tok, prompt_ids=prompt), generated)
    assert "".join(pieces) == " — 日本語 🙂 the end"


def test_special_tokens_are_skipped_in_the_stream(tok: Tokenizer) -> None:
    ids = [1, *tok.encode("hi 🙂"), 2]
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == "hi 🙂"
    raw = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(stream(raw, ids)) == "<|im_start|>hi 🙂<|im_end|>"


def test_flush_releases_an_incomplete_character_at_the_end(tok: Tokenizer) -> None:
    ids = tok.encode("x🙂")[:-1]
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.feed(i) for i in ids) == "x"
    assert detok.flush() == tok.decode(ids)[1:]
    assert detok.flush() == ""


def test_metaspace_leading_spaces_survive_streaming_where_token_by_token_decode_loses_them(
    tmp_path: Path,
) -> None:
    metaspace_bpe().save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    ids = tok.encode("Hello world there")
    assert "".join(tok.decode([i]) for i in ids) == "Helloworldthere"
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == "Hello world there"
    prompt, generated = ids[:1], ids[1:]
    assert "".join(stream(IncrementalDetokenizer(tok, prompt_ids=prompt), generated)) == " world there"


PARITY_TEMPLATES = [
    CHATML,
    "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{{ m | tojson }}{% endfor %}{{ ns.n }}{{ tools | tojson }}{{ bos_token }}",
]


@pytest.mark.external
@pytest.mark.parametrize("template", PARITY_TEMPLATES, ids=["chatml", "trimmed", "namespace_tojson"])
def test_chat_templates_render_like_hf_transformers(tmp_path: Path, template: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": template}
    ours = Tokenizer.from_dir(write_dir(tmp_path, config))
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<|endoftext|>", eos_token="<|im_end|>"
    )
    messages = [*MESSAGES, {"role": "assistant", "content": "wörld", "tool_calls": None}]
    tools = [{"type": "function", "function": {"name": "wörld"}}]
    expected = theirs.apply_chat_template(
        messages, chat_template=template, tokenize=False, tools=tools, add_generation_prompt=True
    )
    assert ours.apply_chat_template(messages, tools=tools) == expected


# -- a floor on the token count from the text's length --------------------------------------------------
FLOOR_TEXTS = [
    "ab " * 2000,
    "x" * 9000,
    " " * 9000,
    "\n\n" * 3000,
    "héllo wörld — 日本語 🙂 " * 300,
    "\u1100\u1161\u11a8" * 1000,  # Hangul jamo that NFC composes into one syllable each (9 bytes -> 3)
    "\U0001d400" * 2000,  # mathematical bold A: NFKC folds its 4 bytes into one
    "<|im_start|>" * 500,
]


def bundled() -> Tokenizer:
    from onnxgen.llm import default_model_dir

    return Tokenizer.from_dir(default_model_dir())


@pytest.mark.parametrize("normalizer", [None, "NFC", "NFKC"])
@pytest.mark.parametrize("make", ["byte-level", "bundled"])
def test_the_floor_from_byte_length_never_exceeds_the_real_token_count(
    make: str, normalizer: str | None
) -> None:
    from tokenizers import normalizers

    tok = bundled() if make == "bundled" else Tokenizer(byte_level_bpe())
    if normalizer is not None:
        tok.backend.normalizer = getattr(normalizers, normalizer)()
    assert tok.max_bytes_per_token is not None
    for text in FLOOR_TEXTS:
        floor = tok.min_tokens(text)
        assert 0 < floor <= len(tok.encode(text, add_special_tokens=False)), text[:12]
    assert tok.min_tokens("ab " * 2_700_000) > 32_768  # an 8 MiB prompt is refused without tokenizing it


def test_a_tokenizer_that_can_drop_or_fold_text_gives_no_floor() -> None:
    from tokenizers import normalizers

    stripping = byte_level_bpe()
    stripping.normalizer = normalizers.Strip()  # " " * n normalizes to nothing
    assert Tokenizer(stripping).max_bytes_per_token is None
    assert Tokenizer(stripping).min_tokens(" " * 9000) == 0 == len(Tokenizer(stripping).encode(" " * 9000))
    splitting = byte_level_bpe()
    splitting.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # whitespace is dropped
    assert Tokenizer(splitting).max_bytes_per_token is None
    unigram = HFTokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0))  # fuses unknown runs
    assert Tokenizer(unigram).max_bytes_per_token is None
