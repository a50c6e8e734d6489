"""Exports other projects made and test against (see each fixture's NOTICE.md): onnxruntime-genai's tiny
GPT-2 (stacked KV caches, int32 inputs) gives the tokens and logits its tests state, and the onnx-genai
model package (static KV cache, textproto model, manifest) decodes like a plain onnxruntime loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import ids, teacher_forced

import onnxgen
from onnxgen import PromptLookup, SamplingParams
from onnxgen.llm import LLM
from onnxgen.runtime.batch import BatchState
from onnxgen.testing import run_teacher_forced

FIXTURES = Path(__file__).parent.parent / "fixtures"
GPT2 = FIXTURES / "tiny-random-gpt2-fp32"
PACKAGE = FIXTURES / "onnx-genai-model-package-cpu"

# onnxruntime-genai test_greedy_search / GreedySearchGptFp32: max_length 10, prompts of 4 tokens.
GPT2_PROMPTS = ([0, 0, 0, 52], [0, 0, 195, 731])
GPT2_GREEDY = ([204] * 6, [731, 114, 114, 114, 114, 114])
# onnxruntime-genai test_get_output: the prompt's logits at every 200th id, both rows, atol 1e-3.
GPT2_PROMPT_LOGITS = np.array(
    [
        [
            [0.29694548, 0.00955007, 0.0430819, 0.10063869, 0.0437237],
            [0.27329233, 0.00841076, -0.1060291, 0.11328877, 0.13369876],
            [0.30323744, 0.0545997, 0.03894716, 0.11702324, 0.0410665],
            [-0.12675379, -0.04443946, 0.14492269, 0.03021223, -0.03212897],
        ],
        [
            [0.29694548, 0.00955007, 0.0430819, 0.10063869, 0.0437237],
            [0.27329233, 0.00841076, -0.1060291, 0.11328877, 0.13369876],
            [-0.04699047, 0.17915794, 0.20838135, 0.10888482, -0.00277808],
            [0.2938929, -0.10538938, -0.00226692, 0.12050669, -0.10622668],
        ],
    ]
)
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def gpt2() -> LLM:
    return onnxgen.load(GPT2, threads=1)


@pytest.fixture(scope="module")
def package() -> LLM:
    return onnxgen.load(PACKAGE, threads=1)


def test_the_gpt2_export_is_derived_with_stacked_caches_and_int32_inputs(gpt2: LLM) -> None:
    io = gpt2.io
    assert [(p.past_key, p.present_key, p.layout) for p in io.kv_pairs] == [
        (f"past_{i}", f"present_{i}", "stacked") for i in range(5)
    ]
    assert (io.kv_pairs[0].kv_heads, io.kv_pairs[0].head_dim, io.kv_mode) == (4, 8, "growing")
    assert {io.port(n).dtype for n in (io.token_input, io.position_ids, io.attention_mask)} == {"int32"}


def test_the_gpt2_prompt_logits_are_the_ones_onnxruntime_genai_states(gpt2: LLM) -> None:
    rows = [gpt2.session.forward(gpt2.session.new_state(16), ids(p)) for p in GPT2_PROMPTS]
    np.testing.assert_allclose(np.concatenate(rows)[:, :, ::200], GPT2_PROMPT_LOGITS, atol=1e-3, rtol=0)


@pytest.mark.parametrize("row", [0, 1])
def test_gpt2_greedy_gives_the_tokens_onnxruntime_genai_states_plain_and_speculative(
    gpt2: LLM, row: int
) -> None:
    prompt = list(GPT2_PROMPTS[row])
    assert gpt2.generate(prompt, GREEDY).token_ids == GPT2_GREEDY[row]
    spec = gpt2.generate(prompt, GREEDY, speculative=PromptLookup(num_draft_tokens=3, min_ngram=1))
    assert spec.token_ids == GPT2_GREEDY[row]
    assert spec.stats["accepted_draft_tokens"] > 0


def test_gpt2_rewound_to_three_tokens_and_fed_again_continues_as_before(gpt2: LLM) -> None:
    """onnxruntime-genai test_rewind: rewind_to(3), append [731, 731], finish: the same sequence."""
    session = gpt2.session
    state = session.new_state(16)
    seq = list(GPT2_PROMPTS[1])
    logits = session.forward(state, ids(seq), 1)[0, -1]
    while len(seq) < 10:
        seq.append(int(logits.argmax()))
        logits = session.forward(state, ids(seq[-1]), 1)[0, -1]
    state.rewind(3)
    logits = session.forward(state, ids([731, 731]), 1)[0, -1]
    again = [0, 0, 195, 731, 731]
    while len(again) < 10:
        again.append(int(logits.argmax()))
        logits = session.forward(state, ids(again[-1]), 1)[0, -1]
    assert again == seq == [*GPT2_PROMPTS[1], *GPT2_GREEDY[1]]


def test_gpt2_batched_rows_give_each_prompts_tokens(gpt2: LLM) -> None:
    session = gpt2.session
    batch = BatchState(session, 2, 16)
    tokens: list[list[int]] = []
    for prompt in (GPT2_PROMPTS[1][1:], GPT2_PROMPTS[0]):  # rows of different lengths
        state = session.new_state(16)
        tokens.append([int(session.forward(state, ids(list(prompt)), 1)[0, -1].argmax())])
        batch.admit(state)
    for _ in range(5):
        out = batch.step([t[-1] for t in tokens])
        for r, row in enumerate(tokens):
            row.append(int(out[r].argmax()))
    alone = gpt2.generate(list(GPT2_PROMPTS[1][1:]), GREEDY).token_ids
    assert tokens == [alone, GPT2_GREEDY[0]]


def test_the_model_package_opens_its_cpu_variant_with_the_declared_static_cache(package: LLM) -> None:
    io = package.io
    assert package.package.model_path == PACKAGE / "cpu" / "model.onnx.textproto"
    assert io.source == "declared" and io.kv_mode == "static"
    assert io.static_cache is not None and io.static_cache.length == 16
    assert (io.static_cache.write_indices, io.static_cache.kv_lengths) == (
        "write_indices",
        "nonpad_kv_seqlen",
    )


def test_the_model_package_decodes_like_a_plain_onnxruntime_loop_alone_speculative_and_batched(
    package: LLM, tmp_path: Path
) -> None:
    import onnx

    onnx.save(onnx.load(str(package.package.model_path)), str(tmp_path / "model.onnx"))
    prompt = [2, 5, 6, 7]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    tokens = package.generate(prompt, params).token_ids
    plain = run_teacher_forced(tmp_path, [prompt], [tokens])[0]
    assert plain[len(prompt) - 1 : -1].argmax(axis=-1).tolist() == tokens
    assert package.generate(prompt, params, speculative=PromptLookup(min_ngram=1)).token_ids == tokens
    session = package.session
    batch = BatchState(session, 2, 16)
    for p in (prompt, [2, 9]):
        state = session.new_state(16)
        session.forward(state, ids(p), 1)
        batch.admit(state)
    out = batch.step([tokens[0], 4])
    np.testing.assert_allclose(out[0], plain[len(prompt)], atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        out[1], teacher_forced(session, session.new_state(16), [2, 9], [4])[-1], atol=1e-5
    )
