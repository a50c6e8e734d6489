"""onnxgen on more exporters' work: onnxruntime-genai builder exports of LFM2, Gemma2 and Phi-3 (fp32 and
int4) and mobius exports of Qwen3.5 (fused and onnx-standard), Qwen3-Next and Qwen2 (with and without a
static cache). Greedy tokens equal transformers' on fp32 exports and onnxruntime-genai's where it runs the
export; speculative and batched decoding reproduce plain greedy; `onnxgen validate` passes on a correct
export and fails on one with a weight perturbed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnxgen
from conftest import MOBIUS, MORE_FAMILIES, genai_greedy, hf_greedy, mobius_id
from onnxgen.cli import main as cli_main
from onnxgen.runtime.batch import BatchState
from onnxgen.validate import validate

if TYPE_CHECKING:
    from conftest import TinyExport, TinyExports

pytestmark = pytest.mark.external

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
N = 16
GREEDY = onnxgen.SamplingParams(max_new_tokens=N, ignore_eos=True)
VALIDATE_PROMPTS = ["1 2 3 4 5 6 7 8 9 10", "40 41 42 43 44 45 46 47"]


def _ours(export: TinyExport, prompt: list[int] = PROMPT) -> list[int]:
    return onnxgen.load(export.onnx_dir, threads=1).generate(prompt, GREEDY).token_ids


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_fp32_builder_exports_give_the_greedy_tokens_of_transformers_and_onnxruntime_genai(
    tiny_exports: TinyExports, family: str
) -> None:
    export = tiny_exports.get(family, "fp32")
    ours = _ours(export)
    assert len(set(ours)) >= 3
    assert ours == hf_greedy(export.hf_dir, PROMPT, N)
    assert ours == genai_greedy(export.onnx_dir, PROMPT, N, max_length=80)


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_int4_builder_exports_give_the_greedy_tokens_of_onnxruntime_genai(
    tiny_exports: TinyExports, family: str
) -> None:
    export = tiny_exports.get(family, "int4")
    assert _ours(export) == genai_greedy(export.onnx_dir, PROMPT, N, max_length=80)


@pytest.fixture(scope="module", params=MOBIUS, ids=[mobius_id(*m) for m in MOBIUS])
def mobius_export(request: pytest.FixtureRequest, tiny_exports: TinyExports) -> TinyExport:
    return tiny_exports.mobius(*request.param)


def test_mobius_exports_give_the_greedy_tokens_of_transformers(mobius_export: TinyExport) -> None:
    llm = onnxgen.load(mobius_export.onnx_dir, threads=1)
    assert llm.eos_token_ids  # from tokenizer.json: mobius writes no genai_config
    ours = llm.generate(PROMPT, GREEDY).token_ids
    assert len(set(ours)) >= 3
    assert ours == hf_greedy(mobius_export.hf_dir, PROMPT, N)
    if mobius_export.precision.endswith("-static"):
        assert llm.io.kv_mode == "static"


def test_mobius_exports_speculate_and_batch_like_plain_greedy(mobius_export: TinyExport) -> None:
    llm = onnxgen.load(mobius_export.onnx_dir, threads=1)
    first = llm.generate(PROMPT, GREEDY).token_ids
    prompt = PROMPT + first + PROMPT
    plain = llm.generate(prompt, GREEDY)
    spec = llm.generate(prompt, GREEDY, speculative=onnxgen.PromptLookup(num_draft_tokens=4))
    assert spec.token_ids == plain.token_ids
    assert spec.stats["proposed_draft_tokens"] > 0  # drafts were verified (and rejected ones rewound)
    drafted = llm.generate(PROMPT, GREEDY, speculative=onnxgen.DraftModel(llm, num_draft_tokens=3))
    assert drafted.token_ids == first and drafted.stats["accepted_draft_tokens"] > 0
    session = llm.session
    batch = BatchState(session, 2, 64)
    rows = [(PROMPT, first[:6]), (prompt[:13], plain.token_ids[:6])]
    for p, _ in rows:
        state = session.new_state(64)
        session.forward(state, np.asarray([p]), 1)
        batch.admit(state)
    got = [batch.step([rows[0][1][t], rows[1][1][t]]) for t in range(6)]
    for r, (p, cont) in enumerate(rows):
        state = session.new_state(64)
        session.forward(state, np.asarray([p]), 1)
        alone = [session.forward(state, np.asarray([[t]]), 1)[0, -1] for t in cont]
        np.testing.assert_allclose(np.stack([g[r] for g in got]), np.stack(alone), atol=1e-4, rtol=0)


def _perturbed_copy(export: TinyExport, out: Path) -> Path:
    shutil.copytree(export.onnx_dir, out, ignore=shutil.ignore_patterns("model.onnx*"))
    model = onnx.load(str(export.model_path))
    weights = [t for t in model.graph.initializer if len(t.dims) == 2 and min(t.dims) >= 32]
    tensor = weights[len(weights) // 2]
    array = numpy_helper.to_array(tensor)
    noise = np.random.default_rng(0).standard_normal(array.shape).astype(array.dtype)
    tensor.CopyFrom(numpy_helper.from_array(array + 0.3 * array.std() * noise, tensor.name))
    onnx.save(model, str(out / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    return out


@pytest.mark.parametrize("name", ["qwen3_fp32", "qwen3_5_fp32"])
def test_validate_passes_an_fp32_export_against_its_checkpoint_and_fails_a_perturbed_one(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    export: TinyExport = request.getfixturevalue(name)
    good = validate(export.onnx_dir, export.hf_dir, prompts=VALIDATE_PROMPTS, new_tokens=8, threads=1)
    assert not good.failures() and good.thresholds.kind == "exact"
    assert good.top1 == 1.0 and good.mean_kl < 1e-8
    broken = _perturbed_copy(export, tmp_path / "broken")
    bad = validate(broken, export.hf_dir, prompts=VALIDATE_PROMPTS, new_tokens=8, threads=1)
    failures = bad.failures()
    assert failures and any("mean KL" in f for f in failures)
    assert any("first top-1 miss at position" in f for f in failures)


def test_inspect_names_the_plan_a_mobius_onnx_standard_export_decodes_on_and_it_matches_the_scan_plan(
    tiny_exports: TinyExports, capsys: pytest.CaptureFixture[str]
) -> None:
    """mobius ``--ep onnx-standard`` writes the Gated DeltaNet as plain Scans, so auto picks the inline plan.
    Its first-step check must compare real numbers (this checkpoint's token 0 gives NaN logits, which once
    made the check fail on NaN != NaN), `inspect` names the plan generation then reports, and the inline
    plan's logits equal the Scan plan's bit for bit over a teacher-forced run."""
    export = tiny_exports.mobius("qwen3_5_text", "onnx-standard", False)
    assert cli_main(["inspect", str(export.onnx_dir), "--json", "--threads", "1"]) == 0
    info = json.loads(capsys.readouterr().out)
    auto = onnxgen.load(export.onnx_dir, threads=1)
    ran = auto.generate(PROMPT, GREEDY)
    assert info["decode_plan"] == ran.stats["decode_plan"] == "inline"
    assert info["decode_plan_check"] == "passed" and "bit for bit" in info["decode_plan_reason"]
    scan = onnxgen.load(export.onnx_dir, threads=1, decode_plan="scan")
    assert scan.generate(PROMPT, GREEDY).token_ids == ran.token_ids
    fed = ran.token_ids[:10]
    inline_logits = _teacher_forced(auto, fed)
    np.testing.assert_array_equal(inline_logits, _teacher_forced(scan, fed))
    assert np.isfinite(inline_logits).all()


def _teacher_forced(llm: onnxgen.LLM, fed: list[int]) -> np.ndarray:
    """The logits after the prompt and after each of ``fed``, fed one token per step."""
    session = llm.session
    state = session.new_state(len(PROMPT) + len(fed))
    rows = [session.forward(state, np.asarray([PROMPT]), 1)[0, -1]]
    rows += [session.forward(state, np.asarray([[t]]), 1)[0, -1] for t in fed]
    return np.stack(rows)
