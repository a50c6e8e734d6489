"""A small deterministic byte-level BPE tokenizer for the random HF checkpoints of :mod:`onnxgen.testing.hf`.

Trained with ``tokenizers`` on embedded English text plus seeded pseudo-words (so any vocab size up to
tens of thousands is reached by real merges), wrapped in ``transformers.PreTrainedTokenizerFast`` and
saved with a ChatML chat template. Ids 0, 1, 2 are ``<|endoftext|>`` (eos, pad), ``<|im_start|>``,
``<|im_end|>``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Qwen3.5's split (transformers' Qwen3_5Tokenizer); the builder re-saves Qwen3.5 tokenizers with it.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model reads a prompt, one token at a time,
and writes the next token it thinks most likely. Attention layers keep a cache of keys and values
for every token they have seen; linear attention layers keep a fixed state instead, updated by a
gated delta rule. Once upon a time there was a little robot who liked to count: one, two, three,
four, five, six, seven, eight, nine, ten. It counted stars at night and grains of sand by day.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is the
capital of France. def main():\n    print("hello")\n    return 0\n
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828. Symbols: + - * / = < > ( ) [ ] { } # @ !
"""

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _corpus(words: int, seed: int = 0) -> Iterator[str]:
    """The embedded text, then seeded pseudo-words in lines of 16 (enough distinct pairs to merge)."""
    yield from _TEXT.splitlines()
    rng = random.Random(seed)
    line: list[str] = []
    for _ in range(words):
        line.append("".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 9))))
        if len(line) == 16:
            yield " ".join(line)
            line = []
    if line:
        yield " ".join(line)


def byte_level_bpe(
    vocab_size: int, min_frequency: int, name_affixes: bool = False
):  # -> (Tokenizer, BpeTrainer)
    """An untrained byte-level BPE with Qwen3.5's pre-tokenizer (the split regex, NFC) and its trainer for
    ``vocab_size`` ids with the special tokens first. ``name_affixes``: the model is saved with empty
    ``continuing_subword_prefix`` / ``end_of_word_suffix`` (as transformers' Qwen2 tokenizer re-saves
    it) instead of null; both mean none."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    affixes: dict[str, Any] = (
        {"continuing_subword_prefix": "", "end_of_word_suffix": ""} if name_affixes else {}
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        **affixes,
    )
    return tok, trainer


def train_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer
    """Train a byte-level BPE of exactly ``vocab_size`` ids (padded with ``<|extra_N|>`` if short)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is below the 256 byte symbols + {len(SPECIAL_TOKENS)} specials"
        )
    tok, trainer = byte_level_bpe(vocab_size, min_frequency=1)
    tok.train_from_iterator(_corpus(words=max(0, vocab_size - 300)), trainer=trainer)
    short = vocab_size - tok.get_vocab_size()
    if short > 0:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(short)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, wanted {vocab_size}")
    return tok


def save_pretrained(tok, out_dir: str | Path, model_max_length: int) -> None:  # tok: tokenizers.Tokenizer
    """Write tokenizer.json / tokenizer_config.json (ChatML template) of ``tok`` through
    ``PreTrainedTokenizerFast`` (eos and pad ``<|endoftext|>``, bos ``<|im_start|>``)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[0],
        bos_token=SPECIAL_TOKENS[1],
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=model_max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def save_tokenizer(out_dir: str | Path, vocab_size: int) -> None:
    """Write tokenizer.json / tokenizer_config.json (ChatML template) of ``vocab_size`` ids to ``out_dir``."""
    save_pretrained(train_tokenizer(vocab_size), out_dir, model_max_length=1 << 20)
