"""The tiny models' tokenizer: a byte-level BPE trained with ``tokenizers`` on text shipped in the package.

Ids 0, 1, 2 are the specials ``<|endoftext|>`` (eos and pad), ``<|im_start|>``, ``<|im_end|>``; then the
256 byte symbols, then merges learned from ``data/corpus.txt``. A vocabulary larger than the corpus can
fill (about 950 ids) is topped up with special ``<|reserved_N|>`` tokens, so the size is always exact.
Training takes milliseconds and is cached per vocab size for the life of the process.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def corpus_text() -> str:
    """The English/Python text the tokenizer is trained on."""
    return resources.files("onnxgen.testing").joinpath("data/corpus.txt").read_text(encoding="utf-8")


@lru_cache(maxsize=8)
def _trained_json(vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus_text()], trainer=trainer)
    short = vocab_size - tok.get_vocab_size()
    if short > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(short)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained tokenizer has {tok.get_vocab_size()} ids, expected {vocab_size}")
    return tok.to_str()


def tiny_tokenizer(vocab_size: int) -> Tokenizer:
    """A fresh :class:`tokenizers.Tokenizer` of exactly ``vocab_size`` ids (trained once per process)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level tokenizer: it needs at least "
            f"{MIN_VOCAB_SIZE} ids (256 bytes + {len(SPECIAL_TOKENS)} specials); raise TinySpec.vocab_size"
        )
    return Tokenizer.from_str(_trained_json(vocab_size))


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Ids of ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` keyed by token."""
    tok = tiny_tokenizer(vocab_size)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"the tiny tokenizer lacks the special tokens {missing}")
    return {t: int(i) for t, i in ids.items() if i is not None}


def _tokenizer_config(tok: Tokenizer, model_max_length: int) -> dict[str, object]:
    added = {
        str(i): {
            "content": t.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": EOS_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_tokenizer(out_dir: str | Path, vocab_size: int, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (ChatML ``chat_template``) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer(vocab_size)
    (out / "tokenizer.json").write_text(
        json.dumps(json.loads(tok.to_str()), indent=2, ensure_ascii=False) + "\n"
    )
    config = _tokenizer_config(tok, model_max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
