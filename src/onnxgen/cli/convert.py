"""``onnxgen convert FILE.gguf OUT_DIR``: write a GGUF file as a model directory (weights mapped exactly)."""

from __future__ import annotations

import argparse


def add_convert(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser(
        "convert",
        help=help_text,
        description="Write a GGUF file (llama, qwen2, qwen3) as a model directory onnxgen and "
        "onnxruntime-genai run: model.onnx with the GGUF's quantized blocks as MatMulNBits, "
        "tokenizer.json, tokenizer_config.json (chat template) and genai_config.json.",
    )
    p.add_argument("gguf", metavar="FILE.gguf", help="the GGUF file")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the model directory to write (created)")
    p.add_argument(
        "--accuracy-level",
        type=int,
        choices=(0, 1, 2, 3, 4),
        default=None,
        help="MatMulNBits accuracy_level: 1 (default) computes with float32 activations, exactly the GGUF's "
        "weights; 4 quantizes activations to int8 (faster, as llama.cpp computes these types)",
    )
    p.add_argument(
        "--float-weights",
        choices=("keep", "int4"),
        default="keep",
        help="F32/F16/BF16 weight matrices: keep them (default) or quantize them to 4-bit blocks of 32 "
        "(smaller and faster; the file's quantized types are never re-quantized)",
    )
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from onnxgen.convert import convert_gguf

    out = convert_gguf(
        args.gguf, args.out_dir, accuracy_level=args.accuracy_level, float_weights=args.float_weights
    )
    print(out)
    return 0
