"""The demo model's tokenizer: byte-level BPE trained on the training corpus, saved for transformers.

The BPE setup (Qwen3.5's split regex + NFC, special tokens at ids 0 ``<|endoftext|>``, 1
``<|im_start|>``, 2 ``<|im_end|>``) and the save with the ChatML template are those of the tokenizers
:mod:`onnxgen.testing.hf` gives its checkpoints (``onnxgen.testing._hf_tokenizer.byte_level_bpe`` and
``save_pretrained``), so the onnxruntime-genai builder re-saves it unchanged. Deterministic for a given
corpus.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from typing import Any

from onnxgen.testing._hf_tokenizer import SPECIAL_TOKENS, byte_level_bpe

EOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2
FIRST_ORDINARY_ID = len(SPECIAL_TOKENS)  # ids below it are the special tokens


def train_bpe(texts: Iterable[str], vocab_size: int) -> Any:  # -> tokenizers.Tokenizer
    """Train a byte-level BPE of exactly ``vocab_size`` ids on ``texts`` (merges seen at least twice),
    saved with the empty name affixes of the builder's re-save, so the bundled ``tokenizer.json`` is this
    one's JSON (compacted)."""
    tok, trainer = byte_level_bpe(vocab_size, min_frequency=2, name_affixes=True)
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the BPE trainer made {tok.get_vocab_size()} ids, wanted {vocab_size}")
    return tok


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
