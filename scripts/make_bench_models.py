"""Build the benchmark models: random Qwen3 (dense) and Qwen3.5 (hybrid) checkpoints, exported by
onnxruntime-genai's model builder for the CPU.

    .venv/bin/python scripts/make_bench_models.py [OUT_DIR]               (default /work/bench-models)
    .venv/bin/python scripts/make_bench_models.py --real [OUT_DIR/real]   (real-size layouts)

Bench size (default): ~60M-parameter exports OUT_DIR/<family>-<precision> in fp32 and int4, checkpoints
in OUT_DIR/hf/<family>.

``--real``: random weights at the layouts of released models, with the bench exports' 32k-token
tokenizer (so the embedding and LM head are smaller than the originals'), written to
OUT_DIR/<layout>-<precision> (default OUT_DIR: /work/bench-models/real):

- ``qwen3-0.6b``: Qwen3-0.6B (28 layers, hidden 1024, 16 query / 8 KV heads of 128, MLP 3072); fp32, int4
- ``qwen3_5-0.8b``: Qwen3.5-0.8B (24 layers, 3 Gated DeltaNet : 1 attention, hidden 1024, attention 8 / 2
  heads of 256, 16 linear heads of 128, MLP 3584); fp32, int4
- ``qwen3_5-2b``: Qwen3.5-2B (as 0.8B with hidden 2048, MLP 6144); int4 (bfloat16 checkpoint)

Prints each export's path and how long it took. Existing exports are kept unless --force is given.
Needs torch, transformers and onnxruntime-genai (the ``external`` extra).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from onnxgen.testing.hf import SIZES, HFSize, build_hf_checkpoint, export_with_genai_builder

FAMILIES = ("qwen3", "qwen3_5")
PRECISIONS = ("fp32", "int4")

_QWEN3_5_0_8B = HFSize(
    hidden=1024,
    layers=24,
    heads=8,
    kv_heads=2,
    head_dim=256,
    intermediate=3584,
    vocab=32000,
    max_position=4096,
    lin_key_heads=16,
    lin_value_heads=16,
    lin_key_dim=128,
    lin_value_dim=128,
    mrope_section=(11, 11, 10),
)
# layout -> (family, geometry, precisions built by default, checkpoint dtype)
REAL_LAYOUTS: dict[str, tuple[str, HFSize, tuple[str, ...], str]] = {
    "qwen3-0.6b": (
        "qwen3",
        replace(_QWEN3_5_0_8B, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072),
        PRECISIONS,
        "float32",
    ),
    "qwen3_5-0.8b": ("qwen3_5", _QWEN3_5_0_8B, PRECISIONS, "float32"),
    # bfloat16 checkpoint (3 GB on disk instead of 6); the builder's int4 export of it still peaks at
    # ~10.4 GB resident (218 s on 2 shared cores): check the free memory before building it
    "qwen3_5-2b": ("qwen3_5", replace(_QWEN3_5_0_8B, hidden=2048, intermediate=6144), ("int4",), "bfloat16"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", nargs="?", help="where to write (default /work/bench-models[/real])")
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument(
        "--precisions", nargs="+", choices=PRECISIONS, help="default: fp32 int4 (real: per layout)"
    )
    p.add_argument("--size", choices=sorted(SIZES), default="bench")
    p.add_argument("--real", action="store_true", help="build the real-size layouts instead")
    p.add_argument("--layouts", nargs="+", choices=sorted(REAL_LAYOUTS), help="with --real (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild checkpoints and exports that exist")
    return p.parse_args(argv)


def _build(
    out: Path,
    name: str,
    family: str,
    size: str | HFSize,
    precisions: list[str],
    args: argparse.Namespace,
    dtype: str = "float32",
) -> None:
    """The checkpoint OUT/hf/NAME, then the exports OUT/NAME-PRECISION."""
    hf_dir = out / "hf" / name
    if args.force or not (hf_dir / "config.json").is_file():
        t0 = time.perf_counter()
        build_hf_checkpoint(family, hf_dir, size=size, seed=args.seed, dtype=dtype)  # type: ignore[arg-type]
        print(f"checkpoint {hf_dir}  ({time.perf_counter() - t0:.1f}s)", flush=True)
    for precision in precisions:
        dst = out / f"{name}-{precision}"
        if (dst / "model.onnx").is_file() and not args.force:
            print(f"{dst}  (exists; --force to rebuild)", flush=True)
            continue
        shutil.rmtree(dst, ignore_errors=True)
        t0 = time.perf_counter()
        export_with_genai_builder(hf_dir, dst, precision, cache_dir=out / "hf" / ".builder-cache")  # type: ignore[arg-type]
        print(f"{dst}  (export {time.perf_counter() - t0:.1f}s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.real:
        out = Path(args.out_dir or "/work/bench-models/real")
        for layout in args.layouts or list(REAL_LAYOUTS):
            family, size, precisions, dtype = REAL_LAYOUTS[layout]
            _build(out, layout, family, size, args.precisions or list(precisions), args, dtype)
    else:
        out = Path(args.out_dir or "/work/bench-models")
        for family in args.families:
            _build(out, family, family, args.size, args.precisions or list(PRECISIONS), args)
    shutil.rmtree(out / "hf" / ".builder-cache", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
