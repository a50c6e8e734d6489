"""ModelPackage: what a model directory holds, opened cheaply (the graph is read without weights)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import onnx
from google.protobuf import json_format, text_format
from google.protobuf.message import DecodeError

from onnxgen.errors import ModelPackageError
from onnxgen.model.checkpoint import NOT_MODEL_SUFFIXES, checkpoint_error, not_a_model
from onnxgen.model.config_files import (
    CHAT_TEMPLATE_NAME,
    INFERENCE_METADATA_NAMES,
    JSON_CONFIG_NAMES,
    TOKENIZER_NAME,
    read_config,
)
from onnxgen.model.external_data import check_external_data
from onnxgen.model.graph_ports import GraphSignature, signature
from onnxgen.model.io import DecoderIO
from onnxgen.model.settings import ModelSettings, resolve_settings

MODEL_FILE = "model.onnx"
ONNX_FOLDER = "onnx"  # hub ONNX repositories: onnx/model.onnx, the tokenizer at the root
MANIFEST_FILE = "manifest.json"
NXRT_INFO_FILE = "nxrt_info.json"
AUXILIARY_MODELS = ("mtp.onnx",)  # beside a decoder, never the decoder (onnxgen.model.mtp)


class ModelPackage:
    """A decoder export on disk: ``model.onnx`` (+ external data) and the config files beside it.

    Open with :meth:`open`. Config files are parsed at open (a malformed one is a
    :class:`~onnxgen.errors.ConfigError`); the decoder I/O (:attr:`io`) and the token/context
    settings (:attr:`settings`) are derived on first access and cached.
    """

    def __init__(
        self,
        model_path: Path,
        graph: onnx.ModelProto,
        configs: dict[str, tuple[Path, dict[str, Any]]],
        root: Path | None = None,
    ):
        self.model_path = model_path
        # the folder of the configs and the tokenizer: the model's own, or the repository root above an
        # ``onnx/`` folder
        self.root = root if root is not None else model_path.parent
        self._graph: onnx.ModelProto | None = graph  # weights not loaded: external tensors are references
        self.configs = configs
        self._notes: list[str] = []
        tok = self.root / TOKENIZER_NAME
        self.tokenizer_path: Path | None = tok if tok.is_file() else None
        tpl = self.root / CHAT_TEMPLATE_NAME
        self.chat_template_path: Path | None = tpl if tpl.is_file() else None

    # -- opening --------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path) -> ModelPackage:
        """Open a model directory, or a ``.onnx`` file inside one.

        A directory whose model is ``onnx/model.onnx`` with the tokenizer and configs beside the ``onnx/``
        folder (the layout of ONNX model repositories on the Hugging Face hub) opens the same way.
        Raises :class:`ModelPackageError` for a missing/unreadable/truncated model or a missing
        external-data file, :class:`ConfigError` for a malformed config file.
        """
        path, root = _layout(_variant_dir(Path(path).expanduser()))
        notes: list[str] = []
        configs = _read_configs(root, notes)
        model_path = _find_model(path, configs.get("genai_config"))
        graph = _load_graph(model_path)
        check_external_data(graph, model_path)
        pkg = cls(model_path, graph, configs, root)
        pkg._notes.extend(notes)
        return pkg

    # -- configs --------------------------------------------------------------------------------
    def config(self, kind: str) -> dict[str, Any] | None:
        """Parsed content of ``inference_metadata``, ``genai_config``, ``hf_config``,
        ``generation_config`` or ``tokenizer_config`` (``None`` when the file is absent)."""
        entry = self.configs.get(kind)
        return entry[1] if entry else None

    def config_path(self, kind: str) -> Path | None:
        entry = self.configs.get(kind)
        return entry[0] if entry else None

    @property
    def inference_metadata(self) -> dict[str, Any] | None:
        return self.config("inference_metadata")

    @property
    def genai_config(self) -> dict[str, Any] | None:
        return self.config("genai_config")

    @property
    def hf_config(self) -> dict[str, Any] | None:
        return self.config("hf_config")

    @property
    def generation_config(self) -> dict[str, Any] | None:
        return self.config("generation_config")

    @property
    def tokenizer_config(self) -> dict[str, Any] | None:
        return self.config("tokenizer_config")

    @property
    def graph(self) -> onnx.ModelProto:
        """The model's graph, external weights as references; read again from the file after
        :meth:`release_graph`."""
        if self._graph is None:
            self._graph = _load_graph(self.model_path)
        return self._graph

    def release_graph(self) -> None:
        """Let the graph go (a loaded model does not need it; an export that keeps its weights inside
        model.onnx would otherwise hold them in Python for as long as the model is loaded). The decoder
        I/O and the signature, derived from it, stay."""
        self.io, self.signature  # noqa: B018 - derived now, while the graph is at hand
        self._graph = None

    # -- derived, cached ------------------------------------------------------------------------
    @cached_property
    def signature(self) -> GraphSignature:
        return signature(self.graph)

    @cached_property
    def io(self) -> DecoderIO:
        from onnxgen.model.derive import derive_io

        return derive_io(self)

    @cached_property
    def settings(self) -> ModelSettings:
        named = {kind: (path.name, data) for kind, (path, data) in self.configs.items()}
        backend = self.tokenizer_backend
        return resolve_settings(named, self.tokenizer_path, backend.token_to_id if backend else None)

    @cached_property
    def tokenizer_backend(self) -> Any:
        """``tokenizer.json`` loaded by the tokenizers library (a ``tokenizers.Tokenizer``), once for the
        settings and the tokenizer; None when absent or not loadable (the tokenizer reports why)."""
        if self.tokenizer_path is None:
            return None
        import tokenizers

        try:
            return tokenizers.Tokenizer.from_file(str(self.tokenizer_path))
        except Exception:  # tokenizers raises plain Exception on malformed files
            return None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.settings.eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self.settings.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.settings.pad_token_id

    @property
    def context_length(self) -> int | None:
        """The configs' context length; a static KV cache's length where that is shorter (or unstated)."""
        stated, static = self.settings.context_length, self.io.static_cache
        if static is None:
            return stated
        return static.length if stated is None else min(stated, static.length)

    @property
    def notes(self) -> tuple[str, ...]:
        """Everything worth telling the user: config disagreements, fallbacks taken."""
        return (*self._notes, *self.settings.notes)

    def __repr__(self) -> str:
        return f"ModelPackage({str(self.model_path)!r})"


def _layout(path: Path) -> tuple[Path, Path]:
    """(where the model is looked for, the folder of its configs and tokenizer). A directory with no
    ``.onnx`` file of its own but an ``onnx/model.onnx``, or a model file in an ``onnx/`` folder without a
    tokenizer whose parent has one: the model in ``onnx/``, the rest in the folder above it."""
    if (
        path.is_dir()
        and (path / ONNX_FOLDER / MODEL_FILE).is_file()
        and not any(p.suffix == ".onnx" and p.name not in AUXILIARY_MODELS for p in path.iterdir())
    ):
        return path / ONNX_FOLDER, path
    folder = path.parent if path.is_file() else path
    beside = folder.name == ONNX_FOLDER and not (folder / TOKENIZER_NAME).is_file()
    if beside and (folder.parent / TOKENIZER_NAME).is_file():
        return path, folder.parent
    return path, folder


def _read_configs(root: Path, notes: list[str]) -> dict[str, tuple[Path, dict[str, Any]]]:
    if not root.is_dir():
        raise ModelPackageError(
            f"model path {root} does not exist or is not a directory; pass a model directory or its model.onnx"
        )
    configs: dict[str, tuple[Path, dict[str, Any]]] = {}
    found = [root / n for n in INFERENCE_METADATA_NAMES if (root / n).is_file()]
    if found:
        configs["inference_metadata"] = (found[0], read_config(found[0]))
        notes.extend(f"{extra.name} ignored: {found[0].name} takes precedence" for extra in found[1:])
    for kind, name in JSON_CONFIG_NAMES.items():
        if (root / name).is_file():
            configs[kind] = (root / name, read_config(root / name))
    return configs


def _not_a_file(path: Path) -> ModelPackageError:
    return ModelPackageError(
        f"{path} is a directory, not an ONNX file; put the exported model file there instead of a folder"
    )


def _variant_dir(path: Path) -> Path:
    """A model package of several variants (``manifest.json`` ``components.model.variants``, the layout
    onnx-genai packages use): the directory of its CPU variant; any other path as given."""
    manifest = path / MANIFEST_FILE
    if not path.is_dir() or (path / MODEL_FILE).is_file() or not manifest.is_file():
        return path
    variants = ((read_config(manifest).get("components") or {}).get("model") or {}).get("variants") or {}
    for variant in variants.values() if isinstance(variants, dict) else ():
        if isinstance(variant, dict) and variant.get("ep", "CPUExecutionProvider") == "CPUExecutionProvider":
            folder = path / str(variant.get("variant_directory", ""))
            if folder.is_dir():
                return folder
    raise ModelPackageError(
        f"{manifest} lists no CPU variant of component 'model' with a directory; pass a variant directory"
    )


def _find_model(path: Path, genai: tuple[Path, dict[str, Any]] | None) -> Path:
    if path.is_file():
        return path
    if (path / MODEL_FILE).is_file():
        return path / MODEL_FILE
    if (path / MODEL_FILE).is_dir():
        raise _not_a_file(path / MODEL_FILE)
    nxrt = path / NXRT_INFO_FILE  # names the variant's model file (e.g. a textproto)
    if nxrt.is_file() and isinstance(named := read_config(nxrt).get("model_file"), str):
        if not (path / named).is_file():
            raise ModelPackageError(f"{path / named} (named by {nxrt.name} model_file) does not exist")
        return path / named
    decoder = ((genai[1].get("model") or {}).get("decoder") or {}) if genai else {}
    filename = decoder.get("filename") if isinstance(decoder, dict) else None
    if isinstance(filename, str) and filename:
        if (path / filename).is_file():
            return path / filename
        if (path / filename).is_dir():
            raise _not_a_file(path / filename)
        raise ModelPackageError(
            f"{path / filename} (named by genai_config.json model.decoder.filename) does not exist; "
            "copy the model file into the directory or fix the filename"
        )
    others = sorted(p.name for p in path.glob("*.onnx") if p.is_file() and p.name not in AUXILIARY_MODELS)
    if path.suffix == ".onnx" and not others:  # a model.onnx path given that is a folder without a model
        raise _not_a_file(path)
    if len(others) == 1:
        return path / others[0]
    if not others and (checkpoint := checkpoint_error(path)) is not None:
        raise checkpoint
    hint = f" (found {', '.join(others)}: pass the one to use)" if others else ""
    raise ModelPackageError(f"{path / MODEL_FILE} does not exist{hint}; export the model into {path}")


def _load_graph(model_path: Path) -> onnx.ModelProto:
    if model_path.stat().st_size == 0:
        raise ModelPackageError(f"{model_path} is empty; re-export or re-copy the model")
    if model_path.suffix.lower() in NOT_MODEL_SUFFIXES:  # onnx.load would parse it as a protobuf text form
        raise not_a_model(model_path)
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except (DecodeError, json_format.ParseError, text_format.ParseError, ValueError, RuntimeError) as e:
        raise ModelPackageError(
            f"{model_path} cannot be parsed as ONNX ({e}); the file is truncated or not an ONNX model: "
            "re-export or re-copy it"
        ) from e
    if not model.HasField("graph") or not model.graph.output or not model.graph.input:
        raise ModelPackageError(
            f"{model_path} has no graph inputs/outputs; the file is truncated or not an ONNX model: "
            "re-export or re-copy it"
        )
    return model
