"""Exports that add to an existing ONNX export: the multi-token-prediction head (``onnxgen export-mtp``)."""

PRECISIONS = ("fp32", "int4")  # of the MTP head's own projections
