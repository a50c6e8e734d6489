"""Tiny deterministic random-weight decoders in every export family, for tests and toy runs.

The engine never imports this package; tests and users who want a toy model do.
"""

from onnxgen.testing.spec import TinySpec, make_weights

__all__ = ["TinySpec", "make_weights"]
