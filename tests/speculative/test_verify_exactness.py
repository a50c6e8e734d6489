"""Speculation on int4 exports with int8 activations gives plain greedy decoding's tokens on every CPU.

A verify forward may compute its rows on other kernels than single decode steps (onnxruntime's attention
multiplies by V with a single-row kernel for one token), and int8 activations grow that last-bit difference
into a different token. The engine probes a verify against single steps once per model and speculates only
where they agree bit for bit (``EngineConfig.exact_speculation``); which way the probe goes depends on the
CPU, so each test asserts what follows from the probe's decision on this machine.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import onnxgen
from onnxgen import DraftModel, PromptLookup, SamplingParams
from onnxgen.generation.generator import EXACT_VERIFY_DRAFTS
from onnxgen.model import ModelPackage
from onnxgen.runtime.batch import lone_row_matches_block
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.verify_check import check_verify, verify_matches_steps
from onnxgen.testing import TinySpec, build_model, int8_activations

# repeats, so prompt lookup finds matches and proposes drafts on every family
PROMPT = [5, 17, 200, 33, 44, 91, 12, 8, 5, 17, 200, 33, 44, 91, 12, 8, 5, 17, 200, 33]
NEW_TOKENS = 220


@pytest.fixture(scope="module")
def int4_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4-int8act")
    out = {}
    for family in ("genai-dense", "hybrid-genai"):
        spec = TinySpec.hybrid() if family.startswith("hybrid") else TinySpec()
        out[family] = int8_activations(build_model(root / family, family, spec, precision="int4"))
    out["fp32"] = build_model(root / "fp32", "genai-dense", TinySpec(), precision="fp32")
    return out


def _session(model_dir: Path) -> DecoderSession:
    package = ModelPackage.open(model_dir)
    return DecoderSession(session_graph(package.model_path, package.io), threads=1)


def test_the_probe_finds_a_verify_that_runs_single_steps_exact(int4_dirs: dict[str, Path]) -> None:
    session = _session(int4_dirs["genai-dense"])
    plain = type(session).forward

    def stepwise(state, ids, num_logits=None, **kw):  # a verify made of single steps: exact by construction
        if ids.shape[1] == 1 or state.length == 0:
            return plain(session, state, ids, num_logits, **kw)
        rows = [plain(session, state, ids[:, i : i + 1], 1)[:, -1].copy() for i in range(ids.shape[1])]
        return np.stack(rows, axis=1)

    session.forward = stepwise  # type: ignore[method-assign]
    check = verify_matches_steps(session)
    assert check.exact, check.detail


def test_the_probe_reports_a_verify_row_that_differs_in_the_last_bit(int4_dirs: dict[str, Path]) -> None:
    session = _session(int4_dirs["genai-dense"])
    plain = type(session).forward

    def nudged(state, ids, num_logits=None, **kw):
        logits = plain(session, state, ids, num_logits, **kw)
        if ids.shape[1] > 1 and state.length > ids.shape[1]:  # the verify, not the prompt
            logits = logits.copy()
            logits[0, 2, 7] = np.nextafter(logits[0, 2, 7], np.float32(np.inf))
        return logits

    session.forward = nudged  # type: ignore[method-assign]
    check = verify_matches_steps(session)
    assert not check.exact
    assert "verify row" in check.detail


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai"])
def test_speculative_greedy_equals_plain_greedy_on_int8_activations_over_200_tokens(
    int4_dirs: dict[str, Path], family: str
) -> None:
    llm = onnxgen.load(int4_dirs[family], threads=1)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    plain = llm.generate(PROMPT, params)
    for speculative in (PromptLookup(), DraftModel(str(int4_dirs[family]))):
        res = llm.generate(PROMPT, params, speculative=speculative)
        assert res.token_ids == plain.token_ids
        exact = check_verify(llm.session).exact  # the verify graph the request ran on, probed
        if lone_row_matches_block(llm.session):
            # attention run position by position makes the verify exact wherever MatMulNBits computes a
            # lone row as it computes a block's: int4 exports speculate there, dense and hybrid
            assert exact and llm.session.serial_width == 1 + min(
                speculative.num_draft_tokens, EXACT_VERIFY_DRAFTS
            )
        if exact:  # this CPU computes a verify as its steps: speculation ran
            assert res.stats["proposed_draft_tokens"] > 0
        else:  # it does not: the request decoded plainly, and says why
            assert res.stats["speculation"].startswith("off: a verify would change greedy output")
            assert "proposed_draft_tokens" not in res.stats


def test_speculation_runs_where_exactness_is_waived(int4_dirs: dict[str, Path]) -> None:
    """The control: the same model and request with ``exact_speculation=False`` really drafts and verifies,
    so the plain decoding above is the exactness rule's doing."""
    llm = onnxgen.load(int4_dirs["genai-dense"], threads=1, exact_speculation=False)
    res = llm.generate(PROMPT, SamplingParams(max_new_tokens=32), speculative=PromptLookup())
    assert res.stats["proposed_draft_tokens"] > 0
    assert "speculation" not in res.stats


def test_fp32_exports_speculate_by_default_and_can_demand_exactness(int4_dirs: dict[str, Path]) -> None:
    params = SamplingParams(max_new_tokens=24)
    default = onnxgen.load(int4_dirs["fp32"], threads=1)
    assert default.generate(PROMPT, params, speculative=PromptLookup()).stats["proposed_draft_tokens"] > 0
    strict = onnxgen.load(int4_dirs["fp32"], threads=1, exact_speculation=True)
    res = strict.generate(PROMPT, params, speculative=PromptLookup())
    if check_verify(strict.session).exact:
        assert res.stats["proposed_draft_tokens"] > 0
    else:
        assert res.stats["speculation"].startswith("off:")


def test_a_batched_speculative_request_equals_plain_greedy_on_int8_activations(
    int4_dirs: dict[str, Path],
) -> None:
    llm = onnxgen.load(int4_dirs["hybrid-genai"], threads=1)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [PROMPT, PROMPT[3:]]
    plain = [llm.generate(p, params).token_ids for p in prompts]
    batched = llm.generate(prompts, params, speculative=PromptLookup())
    assert [r.token_ids for r in batched] == plain


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai"])
def test_mtp_speculation_equals_plain_greedy_on_int8_activations(tmp_path: Path, family: str) -> None:
    from mtp_helpers import build_mtp_model

    from onnxgen import MTP

    llm = onnxgen.load(int8_activations(build_mtp_model(tmp_path, family, "int4")), threads=1)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    plain = llm.generate(PROMPT, params)
    res = llm.generate(PROMPT, params, speculative=MTP(num_draft_tokens=2, auto=False))
    assert res.token_ids == plain.token_ids
    if lone_row_matches_block(llm.session):  # the serialized verify is exact here: the head drafted
        assert res.stats["proposed_draft_tokens"] > 0 and res.stats["accepted_draft_tokens"] > 0
    else:
        assert res.stats["speculation"].startswith("off:")
