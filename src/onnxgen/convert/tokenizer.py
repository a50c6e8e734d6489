"""``tokenizer.json`` and ``tokenizer_config.json`` from a GGUF file's vocabulary, with ``tokenizers``.

Two vocabularies are mapped, as llama.cpp reads them (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE with the file's merges, text split as ``tokenizer.ggml.pre`` names (the
  splits llama.cpp applies for that name; an unknown name is refused, since a wrong split changes the
  tokens silently);
- ``llama``: SentencePiece BPE over ``▁``-spelled pieces with byte fallback; merges are recovered from
  the vocabulary, best score first.

Tokens the file marks as control (type 3) are special added tokens; user-defined ones (type 4) are added
tokens matched whole. ``add_bos_token`` decides whether encoding prepends BOS; the chat template and the
BOS / EOS / pad / unknown tokens go to ``tokenizer_config.json``.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from onnxgen.convert.reader import GGUFFile
from onnxgen.errors import GGUFConversionError

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regexes llama.cpp splits with, in order (each result split by the next)
PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}
_IGNORE_MERGES = ("llama-bpe", "llama3")  # a whole word in the vocabulary wins over its merges
_SPECIALS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id"}
_SPECIALS_PAD = {"pad_token": "padding_token_id"}
CONTROL, USER_DEFINED = 3, 4


def _byte_level(f: GGUFFile, tokens: list[str]) -> Tokenizer:
    pre = f.get("tokenizer.ggml.pre", "default")
    splits = PRE_SPLITS.get(pre)
    if splits is None:
        raise GGUFConversionError(
            f"GGUF tokenizer pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported by onnxgen convert "
            f"(supported: {', '.join(PRE_SPLITS)})"
        )
    merges = [tuple(m.split(" ", 1)) for m in f.require("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(
        models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre in _IGNORE_MERGES)
    )
    steps: list[Any] = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    if pre.startswith("qwen") or pre == "deepseek-r1-qwen":
        tok.normalizer = normalizers.NFC()
    return tok


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a normal piece into two pieces, the
    merged piece's score deciding the order (highest first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, str, str]] = []
    for token, score, kind in zip(tokens, scores, types, strict=True):
        if kind != 1 or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[token], left, right))
    found.sort()
    return [(left, right) for _, _, left, right in found]


def _sentencepiece(f: GGUFFile, tokens: list[str]) -> Tokenizer:
    scores = list(f.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    types = list(f.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    unk = f.get("tokenizer.ggml.unknown_token_id")
    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(
        vocab,
        _spm_merges(tokens, scores, types),
        unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(model)
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", "▁")]
    if f.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps)
    strip = [decoders.Strip(" ", 1, 0)] if f.get("tokenizer.ggml.add_space_prefix", True) else []
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tok


def build_tokenizer(f: GGUFFile) -> Tokenizer:
    """The GGUF vocabulary as a ``tokenizers.Tokenizer`` (ids equal the file's token ids)."""
    kind = f.require("tokenizer.ggml.model")
    tokens = list(f.require("tokenizer.ggml.tokens"))
    if kind == "gpt2":
        tok = _byte_level(f, tokens)
    elif kind == "llama":
        tok = _sentencepiece(f, tokens)
    else:
        raise GGUFConversionError(
            f"GGUF tokenizer model {kind!r} (tokenizer.ggml.model) is not supported by onnxgen convert "
            "(supported: gpt2, llama)"
        )
    types = list(f.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    added = [
        AddedToken(t, special=k == CONTROL, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k in (CONTROL, USER_DEFINED)
    ]
    tok.add_tokens(added)
    _post_processor(f, tok, tokens, byte_level=kind == "gpt2")
    return tok


def _post_processor(f: GGUFFile, tok: Tokenizer, tokens: list[str], byte_level: bool) -> None:
    bos = f.get("tokenizer.ggml.bos_token_id")
    eos = f.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(f.get("tokenizer.ggml.add_bos_token", not byte_level)) and bos is not None
    add_eos = bool(f.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single, special = ["$A"], []
    if add_bos:
        single.insert(0, tokens[bos])
        special.append((tokens[bos], bos))
    if add_eos:
        single.append(tokens[eos])
        special.append((tokens[eos], eos))
    steps: list[Any] = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    if special:
        steps.append(processors.TemplateProcessing(single=single, special_tokens=special))
    if steps:
        tok.post_processor = processors.Sequence(steps)


def tokenizer_config(f: GGUFFile, context: int) -> dict[str, Any]:
    """``tokenizer_config.json``: special tokens, BOS / EOS behaviour and the chat template."""
    tokens = f.require("tokenizer.ggml.tokens")
    byte_level = f.get("tokenizer.ggml.model") == "gpt2"
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(f.get("tokenizer.ggml.add_bos_token", not byte_level)),
        "add_eos_token": bool(f.get("tokenizer.ggml.add_eos_token", False)),
    }
    for name, key in {**_SPECIALS, **_SPECIALS_PAD}.items():
        index = f.get(f"tokenizer.ggml.{key}")
        if index is not None and 0 <= int(index) < len(tokens):
            config[name] = tokens[int(index)]
    template = f.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def special_ids(f: GGUFFile) -> dict[str, Any]:
    """BOS, EOS and pad ids (pad falls back to EOS, as onnxruntime-genai's builder writes it). EOS is a
    list when the file names an end-of-turn token (``eot_token_id``) apart from it."""
    bos = f.get("tokenizer.ggml.bos_token_id")
    eos = f.get("tokenizer.ggml.eos_token_id")
    eot = f.get("tokenizer.ggml.eot_token_id")
    pad = f.get("tokenizer.ggml.padding_token_id", eos)
    ends = [i for i in (eos, eot) if i is not None]
    ends = list(dict.fromkeys(int(i) for i in ends))
    return {"bos": bos, "eos": ends[0] if len(ends) == 1 else (ends or None), "pad": pad}
