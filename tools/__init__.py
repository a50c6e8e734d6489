"""Repository tools that are not part of the installed onnxgen package (run them from the repository root)."""
