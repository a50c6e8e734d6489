import onnxgen


def test_public_api_names_are_pinned() -> None:
    assert set(onnxgen.__all__) >= {"OnnxgenError", "DecoderIOError", "ModelPackageError"}
    assert {"PromptLookup", "DraftModel", "MTP"} <= set(onnxgen.__all__)  # the speculative settings
    for name in onnxgen.__all__:
        assert hasattr(onnxgen, name), name
