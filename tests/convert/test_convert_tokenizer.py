"""``tokenizer.json`` from a GGUF vocabulary: byte-level BPE per ``tokenizer.ggml.pre`` and SentencePiece.

The vocabularies are real BPE vocabularies trained here with ``tokenizers`` (byte-level) or written by
hand (SentencePiece), stored in a GGUF with ``gguf``'s writer. The reference is transformers' own GGUF
tokenizer reader where it is installed; the round trip and llama.cpp's documented splits are checked
without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGUFWriter
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from onnxgen.convert import GGUFConversionError
from onnxgen.convert.reader import GGUFFile
from onnxgen.convert.tokenizer import build_tokenizer, tokenizer_config

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and they'll say we've won 1234567 times!",
    "def main():\n    return [x * 2 for x in range(10)]\n\n\nclass Thing:  pass",
    "Ünïcödé — café, naïve, déjà vu; 日本語のテキスト; emojis 😀🎉",
] * 20
TEXTS = [
    "The fox's 12345 jumps; they'll   go\n\n  home",
    "def f(x):\n\treturn x**2  # 99 bottles",
    "café naïve 日本 😀 and\r\nwindows lines",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_level_vocab() -> tuple[list[str], list[str]]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def write_vocab(path: Path, kind: str, tokens: list[str], **fields: object) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(kind)
    writer.add_token_list(tokens)
    types = fields.pop("types", [3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_types(types)  # type: ignore[arg-type]
    if "pre" in fields:
        writer.add_tokenizer_pre(str(fields.pop("pre")))
    if "merges" in fields:
        writer.add_token_merges(fields.pop("merges"))  # type: ignore[arg-type]
    if "scores" in fields:
        writer.add_token_scores(fields.pop("scores"))  # type: ignore[arg-type]
    for key, value in fields.items():
        if isinstance(value, bool):
            writer.add_bool(f"tokenizer.ggml.{key}", value)
        else:
            writer.add_uint32(f"tokenizer.ggml.{key}", int(value))  # type: ignore[call-overload]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def byte_level() -> tuple[list[str], list[str]]:
    return _byte_level_vocab()


def _transformers_ids(path: Path, text: str) -> list[int]:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ref(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("pre", ["default", "llama-bpe", "qwen2", "smollm"])
def test_byte_level_bpe_round_trips_and_matches_transformers(
    tmp_path: Path, byte_level: tuple[list[str], list[str]], pre: str
) -> None:
    tokens, merges = byte_level
    path = write_vocab(tmp_path / "v.gguf", "gpt2", tokens, pre=pre, merges=merges, eos_token_id=2)
    tok = build_tokenizer(GGUFFile(path))
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
        if pre != "smollm":  # transformers does not know llama.cpp's "smollm" digit split
            assert ids == _transformers_ids(path, text), text


def test_the_pre_tokenizer_name_decides_how_digits_split(
    tmp_path: Path, byte_level: tuple[list[str], list[str]]
) -> None:
    """llama.cpp's splits: gpt2 keeps a digit run, llama-bpe cuts it in threes, qwen2 and smollm in ones."""
    tokens, merges = byte_level

    def pieces(pre: str) -> list[str]:
        path = write_vocab(tmp_path / f"{pre}.gguf", "gpt2", tokens, pre=pre, merges=merges)
        tok = build_tokenizer(GGUFFile(path))
        return tok.pre_tokenizer.pre_tokenize_str("a 1234567")  # type: ignore[union-attr]

    assert [p for p, _ in pieces("default")] == ["a", "Ġ1234567"]
    assert [p for p, _ in pieces("llama-bpe")] == ["a", "Ġ", "123", "456", "7"]
    assert [p for p, _ in pieces("qwen2")] == ["a", "Ġ", "1", "2", "3", "4", "5", "6", "7"]
    assert [p for p, _ in pieces("smollm")] == ["a", "Ġ", "1", "2", "3", "4", "5", "6", "7"]


def test_an_unknown_pre_tokenizer_is_refused_by_name(
    tmp_path: Path, byte_level: tuple[list[str], list[str]]
) -> None:
    tokens, merges = byte_level
    path = write_vocab(tmp_path / "v.gguf", "gpt2", tokens, pre="mystery-v9", merges=merges)
    with pytest.raises(GGUFConversionError, match="pre-tokenizer 'mystery-v9'"):
        build_tokenizer(GGUFFile(path))
    path = write_vocab(tmp_path / "w.gguf", "rwkv", tokens)
    with pytest.raises(GGUFConversionError, match="tokenizer model 'rwkv'"):
        build_tokenizer(GGUFFile(path))


def test_control_tokens_stay_whole_and_bos_follows_add_bos(
    tmp_path: Path, byte_level: tuple[list[str], list[str]]
) -> None:
    tokens, merges = byte_level
    start = tokens.index("<|im_start|>")
    fields = {"pre": "default", "merges": merges, "bos_token_id": start, "add_bos_token": True}
    path = write_vocab(tmp_path / "v.gguf", "gpt2", tokens, **fields)
    tok = build_tokenizer(GGUFFile(path))
    ids = tok.encode("<|im_end|>hi").ids
    assert ids[:2] == [start, tokens.index("<|im_end|>")]
    assert tok.encode("hi", add_special_tokens=False).ids[0] != start
    assert tokenizer_config(GGUFFile(path), 64)["bos_token"] == "<|im_start|>"


SPM_PIECES = [
    "▁",
    "t",
    "h",
    "e",
    "l",
    "o",
    "w",
    "r",
    "d",
    "▁t",
    "he",
    "▁the",
    "ll",
    "▁he",
    "llo",
    "▁hello",
    "▁w",
    "or",
    "▁wor",
    "ld",
    "▁world",
]


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    # longer pieces were learned later: lower scores
    scores = [0.0] * 259 + [-(len(p) * 10 + i * 0.01) for i, p in enumerate(SPM_PIECES)]
    return tokens, scores, types


def test_sentencepiece_vocabularies_use_byte_fallback_and_bos(tmp_path: Path) -> None:
    tokens, scores, types = _spm_vocab()
    fields = {"scores": scores, "types": types, "bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}
    path = write_vocab(tmp_path / "spm.gguf", "llama", tokens, **fields)
    tok = build_tokenizer(GGUFFile(path))
    ids = tok.encode("hello world").ids
    assert [tokens[i] for i in ids] == ["<s>", "▁hello", "▁world"]  # BOS by default for SentencePiece
    ids = tok.encode("the é", add_special_tokens=False).ids
    assert [tokens[i] for i in ids] == ["▁the", "▁", "<0xC3>", "<0xA9>"]
    # llama.cpp (and sentencepiece) prefix every text with a space, even one that starts with spaces
    ids = tok.encode("  world", add_special_tokens=False).ids
    assert [tokens[i] for i in ids] == ["▁", "▁", "▁world"]
    for text in ("hello world", "the é", "  two spaces", "trailing  "):
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
        if not text.startswith(" "):  # transformers' Metaspace prefixes no space there
            assert tok.encode(text, add_special_tokens=False).ids == _transformers_ids(path, text), text
