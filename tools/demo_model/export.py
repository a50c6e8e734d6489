"""From trained weights to ONNX: an HF ``Qwen3_5ForConditionalGeneration`` checkpoint (with the MTP head's
``mtp.*`` tensors in its safetensors, as Qwen3.5 checkpoints ship them), onnxruntime-genai builder exports
of the decoder (fp32, int4), and the fp32 export installed as onnxgen's bundled default model together with
the head's tensors and the checkpoint's ``config.json`` (so the folder is also a checkpoint directory an
MTP exporter can read)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tools.demo_model.config import STOP_IDS, DemoConfig
from tools.demo_model.tokenizer import EOS_ID, IM_START_ID

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_MODEL_DIR = REPO_ROOT / "src" / "onnxgen" / "data" / "default_model"
# The export bundled as the default model. fp32: the trained checkpoint itself (same greedy tokens as
# transformers), and at 4.7M parameters a multi-token forward costs little more than one step, as on
# memory-bound real models, so speculative decoding shows its effect (the int4 export's kernels are
# compute-bound per row here: a 5-token verify costs 2.2-2.7 steps). 19.6 MB instead of int4's 3.7 MB.
BUNDLED_EXPORT = "fp32"
MTP_FILE = "mtp.safetensors"  # the head's tensors in the checkpoint naming, beside each export
# The head as onnxgen runs it (`onnxgen export-mtp`): mtp.onnx reads the decoder's embedding and lm_head
# in model.onnx.data in place; its own projections are int4 so that the fp32 decoder and the head fit the
# bundled folder's 20 MB (an fp32 head would add 2.3 MB).
HEAD_FILES = ("mtp.onnx", "mtp.onnx.data")
HEAD_PRECISION = "int4"
# what an installed default model holds (the builder's files plus our generation_config.json)
MODEL_FILES = (
    "model.onnx",
    "model.onnx.data",
    "genai_config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
BUNDLED_FILES = (*MODEL_FILES, "config.json", *HEAD_FILES)


def save_hf_checkpoint(model: Any, config: DemoConfig, tokenizer_dir: Path, out_dir: Path) -> Path:
    """Save the trained text model (``model.lm`` of a :class:`~tools.demo_model.model.DemoModel`) inside a
    ``Qwen3_5ForConditionalGeneration`` (what the builder reads) with the tokenizer beside it, and the MTP
    head's tensors in the same ``model.safetensors``. The vision tower is the smallest one the class
    builds and is unused."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    from tools.demo_model.mtp import write_mtp_tensors

    torch.manual_seed(config.seed)
    full = Qwen3_5ForConditionalGeneration(config.conditional_config()).float().eval()
    full.model.language_model.load_state_dict(model.lm.model.state_dict())
    full.lm_head.weight = full.model.language_model.embed_tokens.weight
    probe = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        diff = (full(input_ids=probe).logits - model.lm(input_ids=probe).logits).abs().max().item()
    if diff > 1e-4:
        raise RuntimeError(f"the wrapped checkpoint's logits differ from the trained model's by {diff:.2e}")
    full.generation_config.eos_token_id = list(STOP_IDS)
    full.generation_config.pad_token_id = EOS_ID
    out_dir.mkdir(parents=True, exist_ok=True)
    full.save_pretrained(out_dir)
    if model.mtp is not None:
        write_mtp_tensors(out_dir / "model.safetensors", model.mtp.checkpoint_tensors())
    for path in tokenizer_dir.iterdir():  # tokenizer.json, tokenizer_config.json, chat_template.jinja
        shutil.copy2(path, out_dir / path.name)
    return out_dir


def export(hf_dir: Path, out_dir: Path, precision: str) -> Path:
    """Run the onnxruntime-genai model builder (CPU) on the decoder, then add ``generation_config.json``
    and, when the checkpoint has an MTP head, its tensors (``mtp.safetensors``) and ``config.json``: the
    export directory is then what :func:`install_default` bundles."""
    from onnxgen.testing.hf import export_with_genai_builder

    if out_dir.exists():
        shutil.rmtree(out_dir)
    cache = out_dir.with_name(out_dir.name + ".cache")
    # the decoder alone: with the checkpoint's MTP head the builder would also write mtp.onnx and give
    # the decoder a hidden-state output
    extra = {"exclude_mtp": "true"}
    export_with_genai_builder(hf_dir, out_dir, precision, cache_dir=cache, extra_options=extra)  # type: ignore[arg-type]
    shutil.rmtree(cache, ignore_errors=True)
    generation = {"bos_token_id": IM_START_ID, "eos_token_id": list(STOP_IDS), "pad_token_id": EOS_ID}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    add_head(hf_dir, out_dir)
    return out_dir


def reuse_export(init_dir: Path, hf_dir: Path, out_dir: Path) -> Path:
    """The export of a model trained with ``head_only``: the decoder files of the export it started from,
    unchanged, with the newly trained head beside them (:func:`add_head`)."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    for name in MODEL_FILES:
        shutil.copy2(init_dir / name, out_dir / name)
    add_head(hf_dir, out_dir)
    return out_dir


def add_head(hf_dir: Path, out_dir: Path) -> None:
    """When the checkpoint has an MTP head: its tensors (``mtp.safetensors``) and ``config.json`` beside the
    decoder export, and the head as onnxgen runs it (``mtp.onnx``, ``onnxgen export-mtp``; int4 projections
    beside an fp32 decoder, see ``HEAD_PRECISION``), checked against the decoder it reads."""
    from safetensors.torch import save_file

    from onnxgen.export.mtp import check_head, export_mtp
    from tools.demo_model.mtp import read_mtp_tensors

    head = read_mtp_tensors(hf_dir)
    if not head:
        return
    save_file(head, str(out_dir / MTP_FILE), metadata={"format": "pt"})
    shutil.copy2(hf_dir / "config.json", out_dir / "config.json")
    export_mtp(hf_dir, out_dir, HEAD_PRECISION)
    check_head(out_dir)


def install_default(export_dir: Path, target: Path = PACKAGE_MODEL_DIR) -> list[Path]:
    """Replace the files of ``target`` (the bundled default model) with those of ``export_dir``: the
    decoder export, the MTP head (``mtp.onnx``) and the checkpoint's ``config.json``."""
    missing = [name for name in BUNDLED_FILES if not (export_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{export_dir} lacks {', '.join(missing)}; export a model trained with an MTP head first"
        )
    target.mkdir(parents=True, exist_ok=True)
    for old in target.iterdir():
        if old.is_file():
            old.unlink()
    copied = [Path(shutil.copy2(export_dir / name, target / name)) for name in BUNDLED_FILES]
    tokenizer = target / "tokenizer.json"  # the same JSON without indentation: 40% of the size
    tokenizer.write_text(
        json.dumps(json.loads(tokenizer.read_text()), ensure_ascii=False, separators=(",", ":"))
    )
    (target / "NOTICE.txt").write_text(NOTICE)
    return [*copied, target / "NOTICE.txt"]


NOTICE = """\
onnxgen demo model: a small Qwen3.5-layout hybrid trained from scratch by `python -m tools.demo_model.train`
(see docs/demo-model.md in the onnxgen repository).

Its training text is the source of the Python standard library (the .py files that ship with CPython),
Copyright (c) 2001 Python Software Foundation; All Rights Reserved, used under the Python Software
Foundation License Version 2 (the LICENSE.txt file beside the standard library, or
https://docs.python.org/3/license.html). The model can reproduce fragments of that text.
"""


def directory_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
