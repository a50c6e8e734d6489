"""Write the bundled default model (a tiny random-weight hybrid in the onnxruntime-genai layout).

    python scripts/make_default_model.py [OUT_DIR]

The default OUT_DIR is src/onnxgen/data/default_model. Same onnxgen version -> byte-identical files.
"""

from __future__ import annotations

import sys
from pathlib import Path

from onnxgen.testing import TinySpec, build_model

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "onnxgen" / "data" / "default_model"


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    spec = TinySpec.hybrid(num_layers=4, seed=2026)
    print(build_model(out, "hybrid-genai", spec))


if __name__ == "__main__":
    main()
