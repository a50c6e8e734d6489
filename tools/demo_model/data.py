"""Token streams for training and validation, cached under ``OUT/data`` with the tokenizer.

``prepare(out_dir, config)`` builds the corpus, trains the tokenizer on the training text (code and
chat), and writes ``train.npy`` / ``val.npy`` (uint16 ids, one ``<|endoftext|>`` after each document)
plus ``meta.json``. A share of the training text's line ends are tokenization boundaries (see
:func:`tools.demo_model.tokenizer.encode_documents`); validation text is tokenized as one piece per file.
A second call with the same corpus and settings reuses the files.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from onnxgen.testing._hf_tokenizer import save_pretrained
from tools.demo_model.config import DemoConfig
from tools.demo_model.corpus import Corpus, build_corpus
from tools.demo_model.tokenizer import encode_documents, train_bpe


@dataclass(frozen=True)
class Streams:
    train: np.ndarray
    val: np.ndarray
    tokenizer_dir: Path
    meta: dict[str, Any]


def training_documents(corpus: Corpus, seed: int) -> list[str]:
    """The training documents (code, chat, repeats) in a seeded order, so files of one package are not all
    adjacent in the stream; the tokenizer is trained on them in this order."""
    docs = corpus.train + corpus.chat + corpus.repeats
    random.Random(seed).shuffle(docs)
    return docs


def prepare(out_dir: Path, config: DemoConfig, log: Any = print) -> Streams:
    data_dir, tok_dir = out_dir / "data", out_dir / "tokenizer"
    corpus = build_corpus(seed=config.seed)
    digest = corpus.digest()
    meta_path = data_dir / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        settings = (digest, config.vocab_size, config.cut_rate, config.seed)
        if (meta["corpus_sha256"], meta["vocab_size"], meta.get("cut_rate"), meta.get("seed")) == settings:
            log(f"data: reusing {data_dir} (corpus {digest[:12]})")
            return Streams(np.load(data_dir / "train.npy"), np.load(data_dir / "val.npy"), tok_dir, meta)
    log(
        f"data: {len(corpus.train_files)} training files, {len(corpus.val_files)} held out, "
        f"{len(corpus.chat)} chat conversations, {len(corpus.repeats)} repeat documents, from {corpus.root}"
    )
    docs = training_documents(corpus, config.seed)
    tok = train_bpe(docs, config.vocab_size)
    tok_dir.mkdir(parents=True, exist_ok=True)
    save_pretrained(tok, tok_dir, config.context_length)
    train = np.asarray(encode_documents(tok, docs, config.cut_rate, config.seed), dtype=np.uint16)
    val = np.asarray(encode_documents(tok, corpus.val), dtype=np.uint16)
    meta = {
        "corpus_sha256": digest,
        "stdlib": str(corpus.root),
        "vocab_size": config.vocab_size,
        "cut_rate": config.cut_rate,
        "seed": config.seed,
        "train_files": len(corpus.train_files),
        "chat_conversations": len(corpus.chat),
        "repeat_documents": len(corpus.repeats),
        "val_files": corpus.val_files,
        "train_tokens": int(train.size),
        "val_tokens": int(val.size),
        "train_bytes": sum(len(d.encode()) for d in docs),
        "val_bytes": sum(len(d.encode()) for d in corpus.val),
    }
    data_dir.mkdir(parents=True, exist_ok=True)
    np.save(data_dir / "train.npy", train)
    np.save(data_dir / "val.npy", val)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    log(f"data: {train.size} training tokens, {val.size} validation tokens")
    return Streams(train, val, tok_dir, meta)


def batch_at(
    stream: np.ndarray,
    step: int,
    batch: int,
    seq_len: int,
    seed: int,
    repeat_share: float = 0.0,
    random_share: float = 0.0,
    id_range: tuple[int, int] = (0, 0),
    quote_share: float = 0.0,
    quote_span: int = 0,
    quote_gap: int = 64,
) -> np.ndarray:
    """``[batch, seq_len + 1]`` windows at random offsets drawn from ``(seed, step)`` alone, so a
    resumed run sees exactly the batches an uninterrupted one would.

    A ``repeat_share`` of the rows are copy windows instead (:func:`copy_window`): spans of the stream
    each written twice in a row, so half of such a row is predictable only by copying. A further
    ``random_share`` are copy windows of random ids from ``id_range`` (:func:`random_copy_window`), which
    only copying predicts at all. A ``quote_share`` are quote windows (:func:`quote_window`): text in
    which one longer span recurs 2-4 times, near or far apart.
    """
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, stream.size - seq_len - 1, size=batch)
    kinds = rng.random(batch)
    rows = []
    for start, kind in zip(starts, kinds, strict=True):
        if kind < repeat_share:
            rows.append(copy_window(stream, seq_len + 1, rng))
        elif kind < repeat_share + random_share:
            rows.append(random_copy_window(seq_len + 1, id_range, rng))
        elif kind < repeat_share + random_share + quote_share:
            rows.append(quote_window(stream, seq_len + 1, rng, quote_span, quote_gap))
        else:
            rows.append(stream[start : start + seq_len + 1])
    return np.stack(rows).astype(np.int64)


def copy_window(stream: np.ndarray, width: int, rng: np.random.Generator) -> np.ndarray:
    """``width`` ids made of spans of 8-96 ids from random places of ``stream``, each span followed by
    itself (A A B B ...). The spans are unrelated text, so the second copy of each is predictable from
    the first alone: what teaches a small model to copy (induction) within the training budget."""
    parts: list[np.ndarray] = []
    filled = 0
    while filled < width:
        n = int(rng.integers(8, 97))
        start = int(rng.integers(0, stream.size - n))
        span = stream[start : start + n]
        parts += [span, span]
        filled += 2 * n
    return np.concatenate(parts)[:width]


def random_copy_window(width: int, id_range: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """A :func:`copy_window` over uniformly random ids in ``[low, high)``: nothing in such a row is
    predictable except a span's second copy from its first, the pure signal for an induction circuit
    (on real text a model can lean on n-gram statistics instead and copy only what it would have guessed)."""
    return copy_window(rng.integers(id_range[0], id_range[1], size=width), width, rng)


def quote_window(
    stream: np.ndarray, width: int, rng: np.random.Generator, max_span: int = 0, max_gap: int = 64
) -> np.ndarray:
    """``width`` ids of text in which one span of 16 to ``max_span`` (default ``width // 3``) ids recurs
    2-4 times: some text of its own, the span, and again the span after a gap of other text (none half
    the time; otherwise up to ``max_gap`` ids), then other text to the end of the row. What a prompt that
    quotes code or text looks like: copying must hold over the whole span, across distances up to most of
    the row and past several earlier copies, which the short adjacent spans of :func:`copy_window` do not
    teach."""
    n = int(rng.integers(16, max(17, max_span or width // 3)))
    span_at = int(rng.integers(0, stream.size - n))
    span = stream[span_at : span_at + n]

    def text(length: int) -> np.ndarray:
        at = int(rng.integers(0, stream.size - length - 1))
        return stream[at : at + length]

    parts = [text(int(rng.integers(0, width // 4)))]
    for _ in range(int(rng.integers(2, 5))):
        parts.append(span)
        parts.append(text(0 if rng.random() < 0.5 else int(rng.integers(1, max_gap + 1))))
    filled = sum(p.size for p in parts)
    if filled < width:
        parts.append(text(width - filled))
    return np.concatenate(parts)[:width]


def val_windows(stream: np.ndarray, seq_len: int, limit: int | None = None) -> np.ndarray:
    """Consecutive non-overlapping ``[n, seq_len + 1]`` windows of the validation stream (each window's
    first token is context only; every later token is scored once)."""
    n = (stream.size - 1) // seq_len
    if limit is not None:
        n = min(n, limit)
    return np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int64)
