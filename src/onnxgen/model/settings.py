"""Special token ids and context length, from whichever config file states them.

Precedence when files disagree (the first file that states a value wins; every disagreement is
recorded in ``notes``):

- eos / bos / pad token ids: ``inference_metadata`` (``tokens.*``) > ``generation_config.json`` >
  ``genai_config.json`` (``model.*``) > ``config.json`` (top level, else ``text_config``) >
  ``tokenizer_config.json`` (``eos_token`` etc. looked up in ``added_tokens_decoder``, then in
  ``tokenizer.json``). Where none of them states an eos id (mobius packages carry only
  ``tokenizer.json``), the end-of-text tokens ``tokenizer.json`` has by their usual names
  (:data:`EOS_TOKEN_NAMES`) are the eos ids, noted as coming from there.
- context length: ``inference_metadata`` ``model.max_sequence_length`` > ``genai_config.json``
  ``model.context_length`` > ``config.json`` ``max_position_embeddings`` > ``tokenizer_config.json``
  ``model_max_length`` (values of 10^9 and more are HF's "no limit" sentinel and are ignored).

generation_config.json outranks config.json because it is the file HF users edit to change
generation behaviour (and the one transformers reads at generate time); the model's own runtime
metadata (inference_metadata) outranks both because it was written for this exact export.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxgen.errors import ConfigError
from onnxgen.model.geometry import text_config

_NO_LIMIT = 10**9
# End-of-text and end-of-turn tokens by the names tokenizers give them (GPT-2/Qwen, ChatML, Llama 2 and
# Mistral, Gemma, Llama 3, Phi-3).
EOS_TOKEN_NAMES = (
    "<|endoftext|>",
    "<|im_end|>",
    "</s>",
    "<eos>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|end|>",
)
TOKENIZER_SPECIALS = "tokenizer.json special tokens"
Value = int | tuple[int, ...]


@dataclass(frozen=True)
class ModelSettings:
    """What the configs say about special tokens and the context length."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    context_length: int | None = None
    sources: tuple[tuple[str, str], ...] = ()  # (field, file it came from)
    notes: tuple[str, ...] = ()

    def source_of(self, field: str) -> str | None:
        return dict(self.sources).get(field)


def _as_id(value: Any, where: str, key: str, *, many: bool) -> Value | None:
    if value is None:
        return None
    if many and isinstance(value, list):
        ids = tuple(_as_id(v, where, key, many=False) for v in value)
        return tuple(i for i in ids if i is not None) or None  # type: ignore[misc]
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an integer or a list of integers" if many else "an integer"
        raise ConfigError(f"{where}: '{key}' must be {kind}, not {value!r}; fix the file")
    return value if value >= 0 else None


class _TokenLookup:
    """Token string -> id from tokenizer_config's added_tokens_decoder, then tokenizer.json."""

    def __init__(
        self,
        tokenizer_config: Mapping[str, Any],
        tokenizer_path: Path | None,
        token_id: Callable[[str], int | None] | None = None,
    ) -> None:
        self._table: dict[str, int] = {}
        decoder = tokenizer_config.get("added_tokens_decoder") or {}
        if isinstance(decoder, dict):
            for i, tok in decoder.items():
                if isinstance(tok, dict) and str(i).isdigit():
                    self._table[str(tok.get("content"))] = int(i)
        self._tokenizer_path = tokenizer_path
        self._token_id = token_id  # the loaded tokenizer's lookup, when the caller has one
        self._loaded = False

    def _load_tokenizer_json(self) -> None:
        self._loaded = True
        if self._tokenizer_path is None or self._token_id is not None:
            return
        try:
            data = json.loads(self._tokenizer_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{self._tokenizer_path} is not valid JSON: {e}; fix or remove the file") from e
        for tok in data.get("added_tokens") or []:
            if isinstance(tok, dict) and isinstance(tok.get("id"), int):
                self._table.setdefault(str(tok.get("content")), tok["id"])
        vocab = (data.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            for content, i in vocab.items():
                if isinstance(i, int):
                    self._table.setdefault(content, i)

    def known(self, names: tuple[str, ...]) -> dict[str, int]:
        """Those of ``names`` the tokenizer has, with their ids."""
        if not self._loaded:
            self._load_tokenizer_json()
        return {name: self._table[name] for name in names if name in self._table}

    def __call__(self, token: Any) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        if not isinstance(token, str):
            return None
        if token not in self._table and not self._loaded:
            self._load_tokenizer_json()
        if token not in self._table and self._token_id is not None:
            return self._token_id(token)
        return self._table.get(token)


Candidates = dict[str, list[tuple[str, Value]]]
_FIELDS = ("eos_token_id", "bos_token_id", "pad_token_id")


def _add_ids(out: Candidates, label: str, cfg: Mapping[str, Any]) -> None:
    for key in _FIELDS:
        v = _as_id(cfg.get(key), label, key, many=key == "eos_token_id")
        if v is not None:
            out.setdefault(key, []).append((label, v))


def _add_length(out: Candidates, label: str, value: Any, key: str) -> None:
    if value is None:
        return
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    v = _as_id(value, label, key, many=False)
    if isinstance(v, int) and 0 < v < _NO_LIMIT:
        out.setdefault("context_length", []).append((f"{label} {key}", v))


def _collect(
    configs: Mapping[str, tuple[str, Mapping[str, Any]]],
    tokenizer_path: Path | None,
    token_id: Callable[[str], int | None] | None,
) -> Candidates:
    out: Candidates = {}
    get: Callable[[str], tuple[str, Mapping[str, Any]] | None] = configs.get
    if (im := get("inference_metadata")) is not None:
        _add_ids(out, im[0], im[1].get("tokens") or {})
        model = im[1].get("model") or {}
        _add_length(out, im[0], model.get("max_sequence_length"), "model.max_sequence_length")
    if (gen := get("generation_config")) is not None:
        _add_ids(out, *gen)
    if (genai := get("genai_config")) is not None:
        model = genai[1].get("model") or {}
        _add_ids(out, genai[0], model)
        _add_length(out, genai[0], model.get("context_length"), "model.context_length")
    if (hf := get("hf_config")) is not None:
        _add_ids(out, hf[0], hf[1])
        text = text_config(hf[1])
        if text is not hf[1]:
            _add_ids(out, hf[0] + " text_config", text)
        _add_length(out, hf[0], text.get("max_position_embeddings"), "max_position_embeddings")
    if (tc := get("tokenizer_config")) is not None:
        lookup = _TokenLookup(tc[1], tokenizer_path, token_id)
        for key in _FIELDS:
            found_id = lookup(tc[1].get(key.replace("_id", "")))
            if found_id is not None:
                out.setdefault(key, []).append((tc[0], found_id))
        _add_length(out, tc[0], tc[1].get("model_max_length"), "model_max_length")
    if "eos_token_id" not in out and tokenizer_path is not None:
        found = _TokenLookup(tc[1] if tc is not None else {}, tokenizer_path).known(EOS_TOKEN_NAMES)
        if found:
            label = f"{TOKENIZER_SPECIALS} {', '.join(found)}"
            out["eos_token_id"] = [(label, tuple(sorted(set(found.values()))))]
    return out


def _same(a: Value, b: Value) -> bool:
    sa = set(a) if isinstance(a, tuple) else {a}
    sb = set(b) if isinstance(b, tuple) else {b}
    return sa == sb


def _show(v: Value) -> str:
    return str(list(v)) if isinstance(v, tuple) else str(v)


def resolve_settings(
    configs: Mapping[str, tuple[str, Mapping[str, Any]]],
    tokenizer_path: Path | None = None,
    token_id: Callable[[str], int | None] | None = None,
) -> ModelSettings:
    """Apply the precedence above. ``configs`` maps a config kind (``generation_config``, ...) to
    (file name, parsed content). Token strings are looked up with ``token_id`` (the loaded tokenizer's),
    else in ``tokenizer_path`` read as JSON."""
    cands = _collect(configs, tokenizer_path, token_id)
    chosen: dict[str, Value] = {}
    sources: list[tuple[str, str]] = []
    notes: list[str] = []
    for field, items in cands.items():
        (label, value), rest = items[0], items[1:]
        chosen[field] = value
        sources.append((field, label))
        for other, v in rest:
            if not _same(v, value):
                notes.append(f"{field}: {label} says {_show(value)}, {other} says {_show(v)}; using {label}")
    eos = chosen.get("eos_token_id")
    return ModelSettings(
        eos_token_ids=eos if isinstance(eos, tuple) else (() if eos is None else (eos,)),
        bos_token_id=_single(chosen.get("bos_token_id")),
        pad_token_id=_single(chosen.get("pad_token_id")),
        context_length=_single(chosen.get("context_length")),
        sources=tuple(sources),
        notes=tuple(notes),
    )


def _single(v: Value | None) -> int | None:
    if isinstance(v, tuple):
        return v[0] if v else None
    return v
