"""The bundled demo model: a small hybrid (Qwen3.5 layout) trained from scratch on Python's standard library.

``python -m tools.demo_model.train`` rebuilds it end to end (corpus, tokenizer, training on the CPU, HF
checkpoint, onnxruntime-genai exports, installation as the default model); ``python -m
tools.demo_model.report`` measures it. See docs/demo-model.md.

torch, transformers and onnxruntime-genai are imported lazily by the modules that need them; the
engine never imports this package.
"""
