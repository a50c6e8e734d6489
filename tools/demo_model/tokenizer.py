"""The demo model's tokenizer: byte-level BPE trained on the training corpus, saved for transformers.

Same pre-tokenizer (Qwen3.5's split regex + NFC), special tokens (ids 0 ``<|endoftext|>``, 1
``<|im_start|>``, 2 ``<|im_end|>``) and ChatML template as :mod:`onnxgen.testing.hf`'s tokenizers, so
the onnxruntime-genai builder re-saves it unchanged. Deterministic for a given corpus.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from onnxgen.testing._hf_tokenizer import CHAT_TEMPLATE, PRETOKENIZE_REGEX, SPECIAL_TOKENS

EOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2
FIRST_ORDINARY_ID = len(SPECIAL_TOKENS)  # ids below it are the special tokens


def train_bpe(texts: Iterable[str], vocab_size: int) -> Any:  # -> tokenizers.Tokenizer
    """Train a byte-level BPE of exactly ``vocab_size`` ids on ``texts``."""
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
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the BPE trainer made {tok.get_vocab_size()} ids, wanted {vocab_size}")
    return tok


def save_pretrained(tok: Any, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json + tokenizer_config.json (ChatML template) through ``PreTrainedTokenizerFast``."""
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


def encode_documents(tok: Any, docs: list[str], cut_rate: float = 0.0, seed: int = 0) -> list[int]:
    """Token ids of ``docs``, each followed by ``<|endoftext|>`` (special tokens in the text are matched).

    With ``cut_rate`` > 0, that share of line ends (chosen by a seeded RNG) is encoded as a boundary:
    the text before the newline and the text from it on are tokenized separately. The pre-tokenizer
    glues a newline to the punctuation before it (``"):\n"`` is one token), so without cuts the model
    never sees ``"):"`` followed by a newline token, which is exactly what a prompt such as
    ``def f(n):`` (typed without a newline) ends with.
    """
    rng = random.Random(seed)
    pieces: list[str] = []
    ends: list[int] = []  # index in pieces after which a document ends
    for doc in docs:
        start = 0
        if cut_rate > 0:
            for match in _LINE_END.finditer(doc):
                if rng.random() < cut_rate:
                    pieces.append(doc[start : match.start() + 1])
                    start = match.start() + 1
        pieces.append(doc[start:])
        ends.append(len(pieces) - 1)
    ids: list[int] = []
    end_iter = iter(ends)
    next_end = next(end_iter, -1)
    for i, enc in enumerate(tok.encode_batch(pieces, add_special_tokens=False)):
        ids += enc.ids
        if i == next_end:
            ids.append(EOS_ID)
            next_end = next(end_iter, -1)
    return ids


# the last character of a non-empty line, when a newline follows it
_LINE_END = re.compile(r"[^\n](?=\n)")
