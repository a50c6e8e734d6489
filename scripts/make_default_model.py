"""Rebuild the bundled default model: train the demo model and install its int4 export.

    python scripts/make_default_model.py [--out DIR] [--steps N] ...

Same as ``python -m onnxgen.demo.train --install`` (see docs/demo-model.md): the Python standard
library is the corpus, training runs on the CPU (about half an hour on two cores), and the int4 export
of onnxruntime-genai's model builder replaces src/onnxgen/data/default_model/. Needs the ``external``
extras (torch, transformers, onnxruntime-genai).
"""

from __future__ import annotations

import sys

from onnxgen.demo.train import main

if __name__ == "__main__":
    raise SystemExit(main(["--install", *sys.argv[1:]]))
