"""Build the ~60M-parameter benchmark models: random Qwen3 (dense) and Qwen3.5 (hybrid) checkpoints,
exported by onnxruntime-genai's model builder in fp32 and int4 for the CPU.

    .venv/bin/python scripts/make_bench_models.py [OUT_DIR]      (default /work/bench-models)

Writes OUT_DIR/hf/<family> (the checkpoints) and OUT_DIR/<family>-<precision> (the exports), prints each
export's path and how long it took. Existing exports are kept unless --force is given.
Needs torch, transformers and onnxruntime-genai (the ``external`` extra).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from onnxgen.testing.hf import build_hf_checkpoint, export_with_genai_builder

FAMILIES = ("qwen3", "qwen3_5")
PRECISIONS = ("fp32", "int4")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "out_dir", nargs="?", default="/work/bench-models", help="where to write (default %(default)s)"
    )
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    p.add_argument("--size", choices=("bench", "tiny"), default="bench")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild checkpoints and exports that exist")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    for family in args.families:
        hf_dir = out / "hf" / family
        if args.force or not (hf_dir / "config.json").is_file():
            t0 = time.perf_counter()
            build_hf_checkpoint(family, hf_dir, size=args.size, seed=args.seed)
            print(f"checkpoint {hf_dir}  ({time.perf_counter() - t0:.1f}s)", flush=True)
        for precision in args.precisions:
            dst = out / f"{family}-{precision}"
            if (dst / "model.onnx").is_file() and not args.force:
                print(f"{dst}  (exists; --force to rebuild)", flush=True)
                continue
            shutil.rmtree(dst, ignore_errors=True)
            t0 = time.perf_counter()
            export_with_genai_builder(hf_dir, dst, precision, cache_dir=out / "hf" / ".builder-cache")
            print(f"{dst}  (export {time.perf_counter() - t0:.1f}s)", flush=True)
    shutil.rmtree(out / "hf" / ".builder-cache", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
