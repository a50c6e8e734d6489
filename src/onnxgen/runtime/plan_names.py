"""The names of the decode plans (:mod:`onnxgen.runtime.decode_routing`), importable without onnx or onnxruntime
(the command line offers them before anything is loaded)."""

DECODE_PLANS = ("auto", "scan", "inline")
