import onnxgen


def test_public_api_names_are_pinned() -> None:
    assert set(onnxgen.__all__) >= {"OnnxgenError", "DecoderIOError", "ModelPackageError"}
    assert {"PromptLookup", "DraftModel", "MTP"} <= set(onnxgen.__all__)  # the speculative settings
    for name in onnxgen.__all__:
        assert hasattr(onnxgen, name), name


def test_help_onnxgen_shows_every_public_name_with_its_docstring() -> None:
    import inspect
    import pydoc

    text = pydoc.render_doc(onnxgen, renderer=pydoc.plaintext)
    for name in onnxgen.__all__:
        if name == "__version__":
            continue
        obj = getattr(onnxgen, name)
        assert inspect.getdoc(obj), f"{name} has no docstring"
        assert f"class {name}(" in text or f"{name}(" in text, name
    for method in ("generate", "stream", "chat", "stream_chat", "encode", "chat_prompt"):
        assert inspect.getdoc(getattr(onnxgen.LLM, method)), method
