"""Every export family builds, passes the ONNX checker, and computes the numpy reference model."""

from __future__ import annotations

import filecmp
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxgen.testing import FAMILIES, TinySpec, build_model, make_weights
from onnxgen.testing.loop import run_teacher_forced
from onnxgen.testing.reference import reference_logits

DENSE = TinySpec()
HYBRID = TinySpec.hybrid()
DENSE_FAMILIES = ("genai-dense", "standard-dense")
HYBRID_FAMILIES = ("hybrid-genai", "hybrid-mobius", "hybrid-scan")
# Two equal-length prompts (no padding: a linear layer's state would absorb pad tokens), 4 decode steps.
PROMPTS = [[5, 17, 99, 3, 250, 7], [11, 12, 13, 14, 15, 16]]
STEPS = [[40, 41, 42, 43], [50, 51, 52, 53]]
ATOL = 1e-4


def spec_of(family: str) -> TinySpec:
    return HYBRID if family.startswith("hybrid") else DENSE


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: build_model(root / family, family, spec_of(family)) for family in FAMILIES}


@pytest.fixture(scope="module")
def logits(models: dict[str, Path]) -> dict[str, list[np.ndarray]]:
    """Per family: per sequence, the logits of prefill + cached decode steps."""
    return {family: run_teacher_forced(path, PROMPTS, STEPS) for family, path in models.items()}


def reference(spec: TinySpec, tokens: list[int]) -> np.ndarray:
    return reference_logits(spec, make_weights(spec), tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_passes_the_full_onnx_checker(models: dict[str, Path], family: str) -> None:
    onnx.checker.check_model(str(models[family] / "model.onnx"), full_check=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_stores_its_weights_as_external_data(models: dict[str, Path], family: str) -> None:
    model = onnx.load(str(models[family] / "model.onnx"), load_external_data=False)
    external = [t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert "embed" in external and "lm_head" in external
    assert (models[family] / "model.onnx.data").stat().st_size > 4 * DENSE.vocab_size * DENSE.hidden


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_steps_match_the_numpy_reference(
    logits: dict[str, list[np.ndarray]], family: str
) -> None:
    for row, (prompt, steps) in enumerate(zip(PROMPTS, STEPS, strict=True)):
        got = logits[family][row]
        assert got.shape == (len(prompt) + len(steps), spec_of(family).vocab_size)
        np.testing.assert_allclose(got, reference(spec_of(family), prompt + steps), atol=ATOL, rtol=0)


def test_genai_dense_and_standard_dense_built_from_one_spec_give_the_same_logits(
    logits: dict[str, list[np.ndarray]],
) -> None:
    for a, b in zip(logits["genai-dense"], logits["standard-dense"], strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", HYBRID_FAMILIES[1:])
def test_hybrid_families_built_from_one_spec_give_the_same_logits(
    logits: dict[str, list[np.ndarray]], family: str
) -> None:
    for a, b in zip(logits["hybrid-genai"], logits[family], strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("family", "padding"), [("standard-dense", "left"), ("standard-dense", "right"), ("genai-dense", "right")]
)
def test_dense_families_serve_padded_batches_of_different_lengths(
    models: dict[str, Path], family: str, padding: str
) -> None:
    # GroupQueryAttention reads only how many ones a mask row has, so genai exports take right padding.
    prompts = [[5, 17, 99, 3, 250, 7, 8], [11, 12, 13], [20, 21, 22, 23, 24]]
    steps = [[40, 41, 42], [50, 51, 52], [60, 61, 62]]
    got = run_teacher_forced(models[family], prompts, steps, padding=padding)  # type: ignore[arg-type]
    for row, (prompt, cont) in enumerate(zip(prompts, steps, strict=True)):
        np.testing.assert_allclose(got[row], reference(DENSE, prompt + cont), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai"])
def test_genai_families_run_on_one_shared_max_length_kv_buffer(
    models: dict[str, Path], logits: dict[str, list[np.ndarray]], family: str
) -> None:
    shared = run_teacher_forced(models[family], PROMPTS, STEPS, kv_capacity=spec_of(family).max_position)
    for a, b in zip(shared, logits[family], strict=True):
        np.testing.assert_array_equal(a, b)


def test_same_arguments_give_byte_identical_files(tmp_path: Path) -> None:
    a = build_model(tmp_path / "a", "hybrid-genai", HYBRID, precision="int4")
    b = build_model(tmp_path / "b", "hybrid-genai", HYBRID, precision="int4")
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert "model.onnx.data" in names
    for name in names:
        assert filecmp.cmp(a / name, b / name, shallow=False), name


def test_a_different_seed_gives_a_different_model(tmp_path: Path) -> None:
    a = run_teacher_forced(build_model(tmp_path / "a", "genai-dense", DENSE), PROMPTS[:1], STEPS[:1])[0]
    b = run_teacher_forced(
        build_model(tmp_path / "b", "genai-dense", TinySpec(seed=1)), PROMPTS[:1], STEPS[:1]
    )[0]
    assert np.abs(a - b).max() > 1.0


def test_rebuilding_a_directory_as_another_family_leaves_no_stale_config(tmp_path: Path) -> None:
    build_model(tmp_path, "genai-dense")
    assert (tmp_path / "genai_config.json").exists()
    build_model(tmp_path, "standard-dense")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model.onnx",
        "model.onnx.data",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_default_spec_is_hybrid_for_hybrid_families_and_dense_otherwise(tmp_path: Path) -> None:
    hybrid = onnx.load(
        str(build_model(tmp_path / "h", "hybrid-scan") / "model.onnx"), load_external_data=False
    )
    dense = onnx.load(
        str(build_model(tmp_path / "d", "genai-dense") / "model.onnx"), load_external_data=False
    )
    assert any(i.name.endswith("conv_state") for i in hybrid.graph.input)
    assert sum(i.name.startswith("past_key_values.") for i in dense.graph.input) == 2 * DENSE.num_layers


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"family": "onnx-dense"}, "family"),
        ({"family": "standard-dense", "precision": "int4"}, "precision"),
        ({"family": "hybrid-scan", "precision": "int4"}, "precision"),
        ({"family": "genai-dense", "precision": "fp16"}, "precision"),
        ({"family": "genai-dense", "config": "yaml"}, "config"),
        ({"family": "genai-dense", "spec": HYBRID}, "linear layers"),
        ({"family": "hybrid-mobius", "spec": DENSE}, "TinySpec.hybrid"),
        ({"family": "genai-dense", "spec": TinySpec(head_dim=8)}, "head_dim"),
        ({"family": "standard-dense", "spec": TinySpec(vocab_size=100)}, "vocab_size"),
    ],
)
def test_bad_arguments_are_rejected_naming_the_parameter(tmp_path: Path, kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        build_model(tmp_path, **kwargs)
    assert not (tmp_path / "model.onnx").exists()


def test_public_api_of_onnxgen_testing_is_pinned() -> None:
    import onnxgen.testing as t

    assert set(t.__all__) == {
        "CHAT_TEMPLATE",
        "CONFIGS",
        "EXTRA_FAMILIES",
        "FAMILIES",
        "KV_FORMS",
        "PRECISIONS",
        "VARIANTS",
        "SPECIAL_TOKENS",
        "TinySpec",
        "bias_logits",
        "build_model",
        "int8_activations",
        "make_weights",
        "poison_positions",
        "poison_weights",
        "reference_logits",
        "run_teacher_forced",
        "special_token_ids",
        "tiny_tokenizer",
    }
    assert t.FAMILIES == ("genai-dense", "standard-dense", "hybrid-genai", "hybrid-mobius", "hybrid-scan")
    for name in t.__all__:
        assert hasattr(t, name), name


def test_bias_logits_adds_the_bias_to_the_named_tokens_only(tmp_path: Path) -> None:
    from onnxgen import load
    from onnxgen.testing import bias_logits

    ids = np.asarray([[3, 4, 5]], dtype=np.int64)

    def logits(model_dir: Path) -> np.ndarray:
        llm = load(model_dir, threads=1)
        return np.asarray(llm.session.forward(llm.session.new_state(8), ids, None))[0]

    plain = logits(build_model(tmp_path / "plain", "genai-dense"))
    biased = logits(bias_logits(build_model(tmp_path / "biased", "genai-dense"), {7: 2.5, 9: -1.0}))
    expected = np.zeros(plain.shape[-1], dtype=np.float32)
    expected[[7, 9]] = [2.5, -1.0]
    np.testing.assert_allclose(biased - plain, np.broadcast_to(expected, plain.shape), atol=1e-5)
