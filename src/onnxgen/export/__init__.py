"""Exports that add to an existing ONNX export: the multi-token-prediction head (``onnxgen export-mtp``)."""
