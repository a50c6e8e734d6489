"""What a path that is not an ONNX model is, and the one line that says what to do with it.

A Hugging Face checkpoint folder (``config.json`` and ``.safetensors`` weights) is told apart from a
missing export, and answered with the export command of the exporter that fits it; a JSON, YAML or
template file given as the model is named as such instead of reaching the protobuf parser.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from onnxgen.errors import ModelPackageError

# files a user may point at by mistake: onnx.load would read .json and .txt as protobuf text forms
NOT_MODEL_SUFFIXES = (".json", ".yaml", ".yml", ".jinja", ".txt", ".md", ".safetensors", ".bin", ".pt", ".py")
CHECKPOINT_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
# checkpoints onnxruntime-genai's builder does not export and mobius does (config.json model_type)
MOBIUS_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_next")
BUILDER_PACKAGES = "pip install onnxruntime-genai torch==2.13.0 transformers"
MOBIUS_PACKAGES = "pip install mobius-onnx torch==2.13.0 transformers"


def is_checkpoint(path: Path) -> bool:
    """A folder with ``config.json`` and checkpoint weights (safetensors or PyTorch ``.bin``)."""
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and any(next(path.glob(pattern), None) is not None for pattern in CHECKPOINT_WEIGHTS)
    )


def export_command(checkpoint: Path, out: Path) -> str:
    """The command that exports ``checkpoint`` into ``out`` for onnxgen, with the packages it needs:
    mobius for the hybrids onnxruntime-genai's builder does not take (or where only mobius is installed),
    else the builder (int4, CPU)."""
    mobius = _model_type(checkpoint) in MOBIUS_MODEL_TYPES or (
        _installed("mobius") and not _installed("onnxruntime_genai")
    )
    if mobius:
        return (
            f"mobius build --config {checkpoint} {out} --runtime onnx-genai --ep cpu "
            f"(mobius needs torch and transformers: {MOBIUS_PACKAGES})"
        )
    return (
        f"python -m onnxruntime_genai.models.builder -i {checkpoint} -o {out} -p int4 -e cpu "
        f"(the builder needs torch and transformers: {BUILDER_PACKAGES})"
    )


def checkpoint_error(path: Path) -> ModelPackageError | None:
    """The error for a checkpoint folder given as the model (None where ``path`` is not one)."""
    if not is_checkpoint(path):
        return None
    out = path.parent / f"{path.name}-onnx"
    return ModelPackageError(
        f"{path} is a Hugging Face checkpoint (config.json and its weights), not an ONNX export; export it "
        f"first: {export_command(path, out)}; then run {out}"
    )


def not_a_model(path: Path) -> ModelPackageError:
    """The error for a file of another kind (a config, a tokenizer, weights) given as the model."""
    kind = path.suffix.lower().lstrip(".").upper() or "this"
    folder = path.parent
    if any((folder / name).is_file() for name in ("model.onnx", "onnx/model.onnx")):
        return ModelPackageError(
            f"{path} is a {kind} file, not a model; pass the folder that holds it: {folder}"
        )
    return ModelPackageError(
        f"{path} is a {kind} file, not a model; pass a model directory (the folder holding model.onnx), "
        "a .onnx or .gguf file, a name from `onnxgen pull` or a Hugging Face hub id"
    )


def _model_type(checkpoint: Path) -> str | None:
    try:
        data = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = data.get("model_type") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
