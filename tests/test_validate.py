"""`onnxgen validate`: the comparison's numbers, a pass on correct exports (fp32 against itself as exported,
int4 against fp32), a failure that names the position on an export with one weight perturbed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnxgen.cli import main as cli_main
from onnxgen.llm import default_model_dir
from onnxgen.validate import ValidationError, compare, encode_prompts, validate

DEMO = default_model_dir()
FEW = ["def fibonacci(n):\n    if n < 2:\n", "The quick brown fox jumps over the lazy dog. Once upon a time"]
WEIGHT = "model.layers.4.linear_attn.qkv_proj.MatMul.weight"


def _copy_with(tmp_path: Path, name: str, change: object) -> Path:
    """The demo export with its graph changed by ``change(model)`` (weights loaded, saved alongside)."""
    out = tmp_path / name
    shutil.copytree(DEMO, out, ignore=shutil.ignore_patterns("model.onnx*"))
    model = onnx.load(str(DEMO / "model.onnx"))
    model = change(model) or model  # type: ignore[operator]
    onnx.save(model, str(out / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    return out


def _perturb(model: onnx.ModelProto) -> None:
    """One weight tensor moved by 30% of its spread (a broken conversion of one layer)."""
    tensor = next(t for t in model.graph.initializer if t.name == WEIGHT)
    array = numpy_helper.to_array(tensor)
    noise = np.random.default_rng(0).standard_normal(array.shape).astype(array.dtype)
    tensor.CopyFrom(numpy_helper.from_array(array + 0.3 * array.std() * noise, tensor.name))


def _int4(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=True, accuracy_level=4)
    quantizer.process()
    return quantizer.model.model  # type: ignore[no-any-return]


def test_compare_measures_agreement_kl_and_where_greedy_parts_on_synthetic_logits() -> None:
    ref = np.array([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    got = ref.copy()
    got[2] = [0.0, 1.5, 1.0]  # position 2 (the first continuation position of a 2-token prompt) flips
    report = compare(ref, got, prompt_tokens=2)
    assert report.top1 == 0.75 and report.first_top1_miss == 2 and report.greedy_parts_at == 1
    assert report.max_abs == 1.5
    p = np.exp(ref[2]) / np.exp(ref[2]).sum()
    q = np.exp(got[2]) / np.exp(got[2]).sum()
    assert report.mean_kl == pytest.approx(float((p * np.log(p / q)).sum()) / 4)
    same = compare(ref, ref, 2)
    assert (same.top1, same.max_abs, same.mean_kl, same.greedy_parts_at) == (1.0, 0.0, 0.0, None)
    with pytest.raises(ValidationError, match="one vocabulary"):
        compare(ref, ref[:, :2], 2)


def test_prompts_are_text_or_lines_of_token_ids_within_the_vocabulary() -> None:
    assert encode_prompts(["1 2 3"], None, 10) == [[1, 2, 3]]
    with pytest.raises(ValidationError, match="no tokenizer"):
        encode_prompts(["hello"], None, 10)
    with pytest.raises(ValidationError, match=r"outside \[0, 10\)"):
        encode_prompts(["1 20"], None, 10)


def test_self_validation_of_the_bundled_model_passes_with_exact_thresholds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_main(["validate", str(DEMO), "--self", "--new-tokens", "8", "--json", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] and out["thresholds"]["kind"] == "exact" and len(out["prompts"]) == 4
    assert out["top1"] == 1.0 and out["mean_kl"] < 1e-9 and out["max_abs"] < 1e-3


def test_an_int4_export_passes_against_its_fp32_export_with_the_quantized_thresholds(tmp_path: Path) -> None:
    int4 = _copy_with(tmp_path, "int4", _int4)
    report = validate(int4, DEMO, prompts=FEW, new_tokens=12, threads=1)
    assert report.thresholds.kind == "quantized"
    assert not report.failures(), report.failures()
    assert 0.85 <= report.top1 < 1.0 and 1e-3 < report.mean_kl < 0.05  # it is int4: close, not equal


def test_an_export_with_one_perturbed_weight_fails_and_the_report_names_the_position(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = _copy_with(tmp_path, "broken", _perturb)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(p.replace("\n", "\\n") for p in FEW) + "\n")
    argv = ["validate", str(broken), "--reference", str(DEMO), "--prompts", str(prompts), "--threads", "1"]
    assert cli_main([*argv, "--new-tokens", "16"]) == 1
    text = capsys.readouterr().out
    assert "FAILED" in text and "mean KL" in text
    assert "first top-1 miss at position" in text
    # the same export against itself: the comparison itself is not what fails
    assert cli_main(["validate", str(broken), "--reference", str(broken), "--new-tokens", "4"]) == 0


def test_validate_refuses_a_missing_reference_and_needs_reference_or_self(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["validate", str(DEMO), "--reference", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["validate", str(DEMO)])
    with pytest.raises(SystemExit):
        cli_main(["validate", str(DEMO), "--self", "--reference", str(DEMO)])
