"""Tokenizer: HF ``tokenizers`` wrapper, chat template (jinja2 sandbox), incremental detokenizer.

A model directory provides ``tokenizer.json`` and optionally ``tokenizer_config.json`` (special tokens,
``add_bos_token``, ``chat_template``) and ``chat_template.jinja`` (wins over the config's template).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import tokenizers
from tokenizers.decoders import DecodeStream

from onnxgen.chat.messages import template_messages, template_tools
from onnxgen.errors import TokenizerError

if TYPE_CHECKING:
    import jinja2

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

Ids = Sequence[int] | np.ndarray


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} cannot be read ({e}); fix or remove the file") from e


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(_read_text(path))
    except ValueError as e:
        raise TokenizerError(f"{path} cannot be read as JSON ({e}); fix or remove the file") from e


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_template(config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: use the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


@cache
def _generation_tag() -> type:
    """The jinja2 extension that accepts HF's ``{% generation %}...{% endgeneration %}`` blocks and renders
    their body as is (made on first use: jinja2 is imported only where a chat template is compiled)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}  # noqa: RUF012 (jinja2's Extension API)

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

        def _render_body(self, caller: Any) -> str:
            return caller()

    return GenerationTag


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _plain_data(value: Any) -> Any:
    """Rebuilds template inputs from plain JSON types, so no rich object reaches the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain_data(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_data(item) for item in value]
    if isinstance(value, np.generic):
        return _plain_data(value.item())
    for plain in (str, int, float):  # subclasses (enums, ...) lose their extra methods
        if isinstance(value, plain):
            return str.__str__(value) if plain is str else plain(value)
    return f"<{type(value).__name__}>"


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template the way HF transformers does, in an immutable sandbox."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_tag(), loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """A HF fast tokenizer plus what ``tokenizer_config.json`` says about special tokens and chat."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        *,
        template_looked_at: Sequence[str] = (),
    ) -> None:
        self.backend = backend
        config = dict(config or {})
        self.special_tokens = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
        self.add_bos_token = config.get("add_bos_token") is True
        self.chat_template = chat_template if chat_template is not None else _config_template(config)
        self._template_looked_at = tuple(template_looked_at)
        self._compiled: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, path: str | Path, backend: tokenizers.Tokenizer | None = None) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``) from a directory;
        ``backend``: that ``tokenizer.json`` already loaded."""
        directory = Path(path)
        file = directory / TOKENIZER_FILE
        if backend is None and not file.is_file():
            raise TokenizerError(
                f"{file} not found; onnxgen needs the HF fast tokenizer file beside the model "
                "(write it with `AutoTokenizer.from_pretrained(src).save_pretrained(dir)`)"
            )
        try:
            backend = backend or tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises plain Exception on malformed files
            raise TokenizerError(f"{file} cannot be loaded ({e}); re-export the tokenizer") from e
        config_path, template_path = directory / CONFIG_FILE, directory / TEMPLATE_FILE
        config = _read_json(config_path) if config_path.is_file() else {}
        template = _read_text(template_path) if template_path.is_file() else None
        looked_at = (str(template_path), f"{config_path} (chat_template)")
        return cls(backend, config, template, template_looked_at=looked_at)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self.backend.token_to_id(text)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's eos id(s); the model's generation config may add more."""
        eos = self.eos_token_id
        return () if eos is None else (eos,)

    @cached_property
    def max_bytes_per_token(self) -> int | None:
        """How many UTF-8 bytes of input text one token stands for at most, where the tokenizer's pipeline
        proves a bound; None where it may drop or fold arbitrary text (see :func:`text_bytes_per_token`).

        ``len(text.encode()) // max_bytes_per_token`` is then a floor on the number of tokens of ``text``:
        a prompt whose byte length alone exceeds the context can be refused without tokenizing it.
        """
        return text_bytes_per_token(json.loads(self.backend.to_str()))

    def min_tokens(self, text: str) -> int:
        """A floor on ``len(self.encode(text))`` from the length of ``text`` alone (0 without a bound)."""
        bound = self.max_bytes_per_token
        return 0 if bound is None else len(text.encode("utf-8", "surrogatepass")) // bound

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError as e:  # not a str, or one that is no Unicode text (a lone surrogate)
            raise TokenizerError(_not_text(text)) from e
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Ids, skip_special_tokens: bool = True) -> str:
        as_list = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        return self.backend.decode(as_list, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the chat template (HF globals: special tokens, ``tools``, ...).

        ``tools`` (OpenAI function tools or :class:`~onnxgen.chat.tools.Tool`) reach the template as its
        ``tools`` variable; other keyword arguments (``enable_thinking``, ...) as variables of their name.
        Assistant tool calls and tool results are made ready for the template by
        :func:`~onnxgen.chat.messages.template_messages` (arguments given as JSON text become objects).
        """
        template = self._template()
        context: dict[str, Any] = {
            name: text for name, text in self.special_tokens.items() if text is not None
        }
        context.update(tools=template_tools(tools) if tools else None, documents=None)
        context.update(kwargs)
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise TokenizerError(
                    f"chat message {index} must be a mapping such as {{'role': ..., 'content': ...}} (got {message!r})"
                )
        chat = template_messages(messages)
        import jinja2  # imported by the compile above

        try:
            return template.render(
                messages=_plain_data(chat),
                add_generation_prompt=add_generation_prompt,
                **_plain_data(context),
            )
        except (jinja2.TemplateError, TypeError, ValueError) as e:  # raise_exception, sandbox, bad content
            raise TokenizerError(f"the chat template rejected the messages: {e}") from e

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat (no special tokens added: the template writes its own)."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)

    def use_chat_template(self, source: str, origin: str = "the chat template given") -> None:
        """Render chats with ``source`` instead of the template the model's files hold; compiled here, so a
        template that does not compile is an error now rather than at the first chat."""
        self.chat_template, self._compiled, self._template_looked_at = source, None, (origin,)
        self._template()

    def check_chat_template(self) -> None:
        """Raise :class:`TokenizerError` (naming where it looked) where there is no chat template or it
        does not compile: for callers that will chat, so that they fail before the first message."""
        self._template()

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            if self.chat_template is None:
                looked = ", ".join(self._template_looked_at) or "no files (tokenizer built in memory)"
                raise TokenizerError(
                    f"no chat template found (looked at {looked}); add a {TEMPLATE_FILE} file or a "
                    f'"chat_template" entry to {CONFIG_FILE}, or encode a plain prompt instead'
                )
            import jinja2

            try:
                self._compiled = compile_chat_template(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise TokenizerError(
                    f"the chat template does not compile (line {e.lineno}: {e.message})"
                ) from e
        return self._compiled


def _not_text(text: object) -> str:
    """Why ``text`` cannot be tokenized (the tokenizer's own error names no position)."""
    if not isinstance(text, str):
        return f"only text can be tokenized (got {type(text).__name__}: {text!r:.80})"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"the text holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}) at character {e.start}, "
            "which is not a Unicode character; pass valid text (a surrogate must be one of a pair)"
        )
    return f"the tokenizer cannot encode {text[:80]!r}"


# Normalizers that can shorten text, and by how much at most (UTF-8 bytes in / out): Unicode normal forms
# and lowercasing map one character to one or more, except compositions (3 jamo -> one Hangul syllable)
# and compatibility forms (a 4-byte mathematical letter -> one ASCII letter).
_SHRINKING_NORMALIZERS = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


def _normalizer_shrink(spec: Mapping[str, Any] | None) -> int | None:
    """At most how many times shorter (in UTF-8 bytes) the normalizer can make a text; None: unbounded."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for step in spec.get("normalizers") or ():
            inner = _normalizer_shrink(step)
            if inner is None:
                return None
            factor *= inner
        return factor
    if kind == "Replace":  # a fixed string replaced by one at least as long (metaspace's " " -> "▁")
        pattern, content = (spec.get("pattern") or {}).get("String"), spec.get("content")
        if (
            isinstance(pattern, str)
            and isinstance(content, str)
            and len(content.encode()) >= len(pattern.encode())
        ):
            return 1
        return None
    return _SHRINKING_NORMALIZERS.get(str(kind))


def _pre_tokenizer_keeps_text(spec: Mapping[str, Any] | None) -> bool:
    if spec is None:
        return True
    if spec.get("type") == "Sequence":
        return all(_pre_tokenizer_keeps_text(step) for step in spec.get("pretokenizers") or ())
    return spec.get("type") in _KEEPING_PRE_TOKENIZERS and spec.get("behavior") != "Removed"


def _has_byte_level(spec: Mapping[str, Any] | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_has_byte_level(step) for step in spec.get("pretokenizers") or ())
    return spec.get("type") == "ByteLevel"


def text_bytes_per_token(spec: Mapping[str, Any]) -> int | None:
    """An upper bound on the UTF-8 bytes of input one token of the ``tokenizer.json`` ``spec`` covers.

    A BPE model whose normalizer shortens text by a bounded factor, whose pre-tokenizer keeps every
    character, and that maps every character to some token (byte-level, byte fallback, or an unknown
    token per character) gives each token at most ``factor * longest token`` input bytes: a byte-level
    token's characters are one byte each, any other token's text is at most its UTF-8 length (``▁`` and
    ``<0x41>`` stand for fewer bytes than they take). Anything else (WordPiece and Unigram, which can fold
    a whole word into one unknown token, normalizers that strip or replace by pattern, pre-tokenizers that
    drop whitespace) gets None.
    """
    model = spec.get("model") or {}
    shrink = _normalizer_shrink(spec.get("normalizer"))
    byte_level = _has_byte_level(spec.get("pre_tokenizer"))
    covered = byte_level or model.get("byte_fallback") or model.get("unk_token") is not None
    if model.get("type") != "BPE" or model.get("fuse_unk") or not covered or shrink is None:
        return None
    if not _pre_tokenizer_keeps_text(spec.get("pre_tokenizer")):
        return None
    vocab = model.get("vocab") or {}
    longest = max((len(t) if byte_level else len(t.encode()) for t in vocab), default=1)
    added = max((len(str(t.get("content", "")).encode()) for t in spec.get("added_tokens") or ()), default=1)
    return shrink * max(longest, added, 4)  # 4: an unknown character becomes one token


class IncrementalDetokenizer:
    """Streams token ids to text without splitting UTF-8 characters or losing leading spaces.

    The text streamed is what one decode of ``prompt tail + generated ids`` adds to the decode of the
    prompt tail (up to 5 prompt ids give the first generated token its context, as in vLLM/TGI), so
    tokenizers whose decode depends on neighbours (byte-level BPE, metaspace) stream the same text as one
    decode. Per token it takes one step of ``tokenizers``' own streaming decoder (``DecodeStream``, in
    Rust), which holds back an incomplete multi-byte character until it completes; :meth:`flush` releases
    whatever is left at the end (one full decode, once).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Ids = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._context = [int(i) for i in prompt_ids][-5:]
        self.ids: list[int] = []
        self._emitted = 0  # characters streamed so far
        self._stream = DecodeStream(ids=self._context, skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, token_id: int) -> str:
        """Add one token id; return the text it completes (possibly empty)."""
        self.ids.append(int(token_id))
        piece = self._stream.step(self.tokenizer.backend, int(token_id)) or ""
        self._emitted += len(piece)
        return piece

    def flush(self) -> str:
        """Return the held-back text (at the end of generation), even an incomplete character."""
        full = self._decode(self._context + self.ids)[len(self._decode(self._context)) :]
        rest = full[self._emitted :]
        self._emitted = len(full)
        self._stream = DecodeStream(
            ids=self._context + self.ids, skip_special_tokens=self.skip_special_tokens
        )
        return rest
