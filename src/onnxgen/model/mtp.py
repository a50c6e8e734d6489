"""An MTP head beside a decoder export: where it is, and its I/O, derived like the decoder's.

Where: ``genai_config.json`` ``model.mtp.filename`` (onnxruntime-genai's builder writes that section when
it exports a head; ``enabled: false`` turns it off), else ``mtp.onnx`` in the decoder's directory (what
``onnxgen export-mtp`` writes).

I/O: the head is a one-layer decoder with one more input, the target's hidden state. Its roles (token
input, mask, position ids, logits) and KV pairs come from :func:`onnxgen.model.derive.derive_io` on the
head's graph, with ``genai_config.json`` ``model.mtp`` ``inputs``/``outputs`` (the same name templates as
``model.decoder``'s) as the stated source where present. The hidden-state ports: ``model.mtp`` names them
(``inputs.hidden_states``, ``outputs.hidden_states``), else the input ``hidden_states`` and the output
``hidden_states_out``, else the only float rank-3 input / the only float rank-3 output besides the logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from onnxgen.errors import AmbiguousIOError, DecoderIOError, ModelPackageError
from onnxgen.model.derive import derive_io
from onnxgen.model.external_data import check_external_data
from onnxgen.model.io import DecoderIO, Port
from onnxgen.model.package import ModelPackage

MTP_FILE = "mtp.onnx"
HIDDEN_INPUT = "hidden_states"
HIDDEN_OUTPUT = "hidden_states_out"
_FLOAT = {"float32", "float16"}


@dataclass(frozen=True)
class MTPHeadIO:
    """The head's decoder roles and KV pairs (``io``) and its hidden-state input and output."""

    path: Path
    io: DecoderIO
    hidden_input: str
    hidden_output: str
    hidden_size: int


def _mtp_section(package: ModelPackage) -> dict[str, Any] | None:
    model = (package.genai_config or {}).get("model")
    section = model.get("mtp") if isinstance(model, dict) else None
    return section if isinstance(section, dict) else None


def find_mtp_head(package: ModelPackage) -> Path | None:
    """The head file of ``package``, or None when it has none."""
    section = _mtp_section(package)
    if section is not None:
        if section.get("enabled") is False:
            return None
        name = section.get("filename") or MTP_FILE
        path = package.root / str(name)
        if not path.is_file():
            raise ModelPackageError(
                f"genai_config.json model.mtp names {name}, which is not in {package.root}; copy it there "
                "or remove the mtp section"
            )
        return path
    path = package.root / MTP_FILE
    return path if path.is_file() else None


def _named(section: dict[str, Any] | None, side: str) -> str | None:
    ports = (section or {}).get(side)
    name = ports.get("hidden_states") if isinstance(ports, dict) else None
    return name if isinstance(name, str) and name else None


def _pick(ports: tuple[Port, ...], stated: str | None, default: str, skip: set[str], what: str) -> Port:
    names = {p.name: p for p in ports}
    if stated is not None:
        if stated not in names:
            raise DecoderIOError(
                f"genai_config.json model.mtp names {what} {stated!r}, which the head has not"
            )
        return names[stated]
    if default in names:
        return names[default]
    cands = [p for p in ports if p.name not in skip and p.dtype in _FLOAT and p.rank_known and p.rank == 3]
    if len(cands) != 1:
        found = ", ".join(p.name for p in cands) or "none"
        error = AmbiguousIOError if cands else DecoderIOError
        raise error(
            f"cannot tell the MTP head's {what} (float rank-3 candidates: {found}); name it in "
            f"genai_config.json model.mtp ({'inputs' if 'input' in what else 'outputs'}.hidden_states)"
        )
    return cands[0]


def mtp_head_io(package: ModelPackage, path: Path) -> MTPHeadIO:
    """Derive and check the I/O of the head at ``path`` beside the decoder of ``package``."""
    try:
        graph = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises its own types
        raise ModelPackageError(f"{path} cannot be parsed as ONNX ({e}); re-export the MTP head") from e
    check_external_data(graph, path)
    section = _mtp_section(package)
    configs = {k: v for k, v in package.configs.items() if k == "hf_config"}
    genai_path = package.config_path("genai_config")
    if section is not None and genai_path is not None:  # model.mtp has model.decoder's templates
        configs["genai_config"] = (genai_path, {"model": {"decoder": section}})
    head = ModelPackage(path, graph, configs)
    sig = head.signature
    hidden_in = _pick(sig.inputs, _named(section, "inputs"), HIDDEN_INPUT, set(), "hidden-state input")
    io = derive_io(head, fed={hidden_in.name})
    taken = {io.logits, *(n for p in io.kv_pairs for n in p.outputs), *(s.output for s in io.state_pairs)}
    hidden_out = _pick(sig.outputs, _named(section, "outputs"), HIDDEN_OUTPUT, taken, "hidden-state output")
    if not io.kv_pairs or io.state_pairs:
        raise DecoderIOError(
            f"{path} has {len(io.kv_pairs)} KV pairs and {len(io.state_pairs)} recurrent states; an MTP head "
            "is one attention layer with its own KV cache and no recurrent state"
        )
    sizes = {d for d in (hidden_in.shape[-1:] + hidden_out.shape[-1:]) if isinstance(d, int)}
    if len(sizes) != 1:
        raise DecoderIOError(
            f"{path}: the hidden-state input {hidden_in.name!r} {list(hidden_in.shape)} and output "
            f"{hidden_out.name!r} {list(hidden_out.shape)} need one static hidden size"
        )
    return MTPHeadIO(path, io, hidden_in.name, hidden_out.name, sizes.pop())


__all__ = ["HIDDEN_INPUT", "HIDDEN_OUTPUT", "MTP_FILE", "MTPHeadIO", "find_mtp_head", "mtp_head_io"]
