"""The bundled default model (the trained demo model, fp32 onnxruntime-genai export) and its tooling."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

import onnxgen
from onnxgen import SamplingParams
from onnxgen.cli import main
from onnxgen.demo.corpus import SYSTEM_PROMPT, chatml
from onnxgen.demo.measure import prefill_logits_fn, simulate_prompt_lookup
from onnxgen.llm import default_model_dir

# Not a standard library file: ordinary Python a model trained on Python should find likely.
SNIPPET = '''import os


def list_python_files(directory):
    """Return the paths of the Python files under directory."""
    paths = []
    for root, dirs, files in os.walk(directory):
        for name in files:
            if name.endswith(".py"):
                paths.append(os.path.join(root, name))
    return paths
'''


@pytest.fixture(scope="module")
def llm() -> onnxgen.LLM:
    return onnxgen.load(threads=1)


def test_load_without_a_model_opens_the_bundled_directory(llm: onnxgen.LLM) -> None:
    assert llm.package.root.resolve() == default_model_dir().resolve()
    assert llm.tokenizer is not None and llm.tokenizer.vocab_size == 4096
    assert set(llm.eos_token_ids) == {0, 2}  # <|endoftext|> and <|im_end|>


def test_the_bundled_model_is_small_and_complete() -> None:
    files = {p.name: p.stat().st_size for p in default_model_dir().iterdir()}
    for name in (
        "model.onnx",
        "model.onnx.data",
        "genai_config.json",
        "tokenizer.json",
        "chat_template.jinja",
    ):
        assert name in files
    assert sum(files.values()) < 22_000_000  # the fp32 export: 19.6 MB
    genai = json.loads((default_model_dir() / "genai_config.json").read_text())
    assert genai["model"]["type"] == "qwen3_5_text"


def test_inspect_reports_a_hybrid_with_state_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(default_model_dir()), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["family"].startswith("hybrid")
    assert "MatMulNBits" not in out["ops"].get("com.microsoft", {})  # the fp32 export (BUNDLED_EXPORT)
    assert [p["layer"] for p in out["kv_pairs"]] == [3, 7]  # one full-attention layer in four
    kinds = {(p["layer"], p["kind"]) for p in out["state_pairs"]}
    assert kinds == {(i, k) for i in (0, 1, 2, 4, 5, 6) for k in ("conv", "recurrent")}
    recurrent = next(p for p in out["state_pairs"] if p["kind"] == "recurrent")
    assert recurrent["shape"][1:] == [4, 64, 64]  # Hv = 4 value heads (Hk = 2 key heads)


def test_greedy_generation_is_deterministic(llm: onnxgen.LLM) -> None:
    params = SamplingParams(max_new_tokens=24)
    first = llm.generate("def fibonacci(n):", params)
    assert llm.generate("def fibonacci(n):", params).token_ids == first.token_ids


def test_seeded_sampling_repeats_per_seed_and_varies_across_seeds(llm: onnxgen.LLM) -> None:
    def sample(seed: int) -> list[int]:
        params = SamplingParams(max_new_tokens=32, temperature=1.0, seed=seed, ignore_eos=True)
        return llm.generate("import ", params).token_ids

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_a_def_is_continued_with_an_indented_python_body(llm: onnxgen.LLM) -> None:
    text = llm.generate("def fibonacci(n):", SamplingParams(max_new_tokens=48)).text
    assert text.startswith("\n    ")  # a random model picks this newline-then-indent with p ~ 1/4096
    assert any(word in text for word in ("return", "if ", '"""'))


def test_the_model_finds_real_python_far_likelier_than_the_same_tokens_shuffled(llm: onnxgen.LLM) -> None:
    ids = np.array([llm.encode(SNIPPET)], dtype=np.int64)
    shuffled = ids[:, np.random.default_rng(0).permutation(ids.shape[1])]
    run = prefill_logits_fn(default_model_dir())

    def mean_nll(x: np.ndarray) -> float:
        logits = run(x)[0, :-1].astype(np.float64)
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        return float((logz - logits[np.arange(len(logits)), x[0, 1:]]).mean())

    real, scrambled = mean_nll(ids), mean_nll(shuffled)
    assert real < 3.5  # uniform guessing is ln(4096) = 8.3 nats; held-out stdlib text is ~3.6
    assert scrambled - real > 2.0


def test_chat_answers_end_at_im_end(llm: onnxgen.LLM) -> None:
    """Sampled chat answers mostly end on their own at <|im_end|> (greedy decoding of a 4.7M model often
    falls into a loop instead, so the test samples: seeded, several questions)."""
    questions = (
        "What does `os.path.join` do?",
        "Write `is_prime(n)` from the math module.",
        "What does `json.dumps` do?",
        "What does `re.compile` do?",
        "Write `flatten(items)`.",
    )
    ended = 0
    for question in questions:
        for seed in (0, 1):
            params = SamplingParams(max_new_tokens=128, temperature=0.7, top_p=0.95, seed=seed)
            result = llm.chat([{"role": "user", "content": question}], params)
            if result.finish_reason == "stop":
                assert result.token_ids[-1] == 2  # <|im_end|>
                ended += 1
    assert ended >= 5, f"only {ended} of 10 sampled chat answers ended at <|im_end|>"


def test_the_training_conversations_render_like_the_bundled_chat_template(llm: onnxgen.LLM) -> None:
    assert llm.tokenizer is not None
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hi"}]
    rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    turns = [("system", SYSTEM_PROMPT), ("user", "Hi")]
    assert rendered == chatml(turns) + "<|im_start|>assistant\n"


def test_prompt_lookup_replay_counts_drafts_and_acceptances() -> None:
    # the repeated [1, 2] proposes [3, 4, 5] (trimmed so the last token stays the model's): all accepted
    copied = simulate_prompt_lookup([1, 2, 3, 4, 5, 1, 2], [3, 4, 5, 9])
    assert (copied.verify_steps, copied.drafted, copied.accepted) == (1, 3, 3)
    # [7, 8] proposes [9, 7] but the model says 1; then nothing matches
    missed = simulate_prompt_lookup([7, 8, 9, 7, 8], [1, 2, 3])
    assert (missed.verify_steps, missed.drafted, missed.accepted) == (3, 2, 0)
    assert missed.acceptance == 0.0 and copied.tokens_per_step == 4.0


def test_the_fast_gated_delta_rule_matches_transformers() -> None:
    torch = pytest.importorskip("torch")
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from onnxgen.demo.gdn import chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 70, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(2, 70, 4, 8, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(2, 70, 4, generator=gen))
    beta = torch.rand(2, 70, 4, generator=gen)
    state = torch.randn(2, 4, 16, 8, generator=gen)
    kwargs = {"initial_state": state, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    want_out, want_state = qwen.torch_chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(final, want_state, atol=1e-5, rtol=1e-4)


def test_copy_windows_write_every_span_twice_in_a_row() -> None:
    from onnxgen.demo.data import copy_window

    stream = np.arange(10_000, dtype=np.uint16)  # distinct ids: a span's place in the stream is its ids
    row = copy_window(stream, 513, np.random.default_rng(3))
    assert row.shape == (513,)
    i = 0
    while i < 513:  # each span is a run of consecutive ids followed by the same run
        n = 1
        while i + n < 513 and row[i + n] == row[i + n - 1] + 1:
            n += 1
        assert 8 <= n <= 96 or i + n == 513
        second = row[i + n : i + 2 * n]
        assert np.array_equal(second, row[i : i + len(second)])
        i += 2 * n


def test_quote_windows_repeat_one_long_span_two_to_four_times_inside_text() -> None:
    from onnxgen.demo.data import quote_window

    stream = np.arange(60_000, dtype=np.uint16)  # distinct ids: ids seen twice in a row belong to the span
    copies, lengths, gaps = set(), set(), set()
    for seed in range(40):
        row = quote_window(stream, 513, np.random.default_rng(seed))
        assert row.shape == (513,)
        ids, counts = np.unique(row, return_counts=True)
        span = ids[counts >= 2]
        assert 16 <= len(span) <= 513 // 3 and np.all(np.diff(span) == 1)  # one span of the stream
        starts = np.flatnonzero(row == span[0])
        for at in starts[:-1]:  # every copy but the last (which the row may cut) is the whole span
            assert np.array_equal(row[at : at + len(span)], span)
        copies.add(len(starts))
        lengths.add(len(span))
        gaps.update(int(b - a - len(span)) for a, b in itertools.pairwise(starts))
    assert copies >= {2, 3} and copies <= {2, 3, 4}
    assert 0 in gaps and max(gaps) > 16 and max(gaps) <= 64  # copies adjacent or apart
    assert min(lengths) < 60 and max(lengths) > 120


def test_training_batches_depend_on_seed_and_step_only_and_mix_in_copy_windows() -> None:
    from onnxgen.demo.data import batch_at

    stream = np.arange(50_000, dtype=np.uint16)
    a = batch_at(stream, 7, 64, 128, 0, repeat_share=0.25)
    assert np.array_equal(a, batch_at(stream, 7, 64, 128, 0, repeat_share=0.25))
    assert not np.array_equal(a, batch_at(stream, 8, 64, 128, 0, repeat_share=0.25))
    plain = np.all(np.diff(a, axis=1) == 1, axis=1)  # a window of the stream counts up by one
    assert 4 <= int((~plain).sum()) <= 32  # about a quarter of 64 rows are copy windows
    assert np.all(np.diff(batch_at(stream, 7, 64, 128, 0), axis=1) == 1)  # share 0: stream windows only


def test_random_copy_rows_repeat_spans_of_random_ordinary_ids() -> None:
    from onnxgen.demo.data import batch_at, random_copy_window

    row = random_copy_window(513, (3, 4096), np.random.default_rng(5))
    assert row.shape == (513,) and row.min() >= 3 and row.max() < 4096
    assert len(np.unique(row)) > 100  # random ids, not a run of the stream
    stream = np.arange(50_000, dtype=np.uint16)
    a = batch_at(stream, 7, 64, 128, 0, repeat_share=0.25, random_share=0.25, id_range=(60_000, 61_000))
    random_rows = np.all(a >= 60_000, axis=1)
    assert 4 <= int(random_rows.sum()) <= 32  # about a quarter of 64 rows
    copies = ~random_rows & ~np.all(np.diff(a, axis=1) == 1, axis=1)
    assert 4 <= int(copies.sum()) <= 32


def test_batches_mix_in_quote_windows_by_share() -> None:
    from onnxgen.demo.config import DemoConfig
    from onnxgen.demo.data import batch_at

    stream = np.arange(50_000, dtype=np.uint16)
    a = batch_at(stream, 7, 64, 128, 0, quote_share=0.5)
    quoted = ~np.all(np.diff(a, axis=1) == 1, axis=1)
    assert 16 <= int(quoted.sum()) <= 48
    for row in a[quoted]:
        assert np.unique(row).size < row.size  # a span recurs
    cfg = DemoConfig(steps=10, copy_phase_steps=5, copy_phase_quote_share=0.25)
    assert cfg.row_shares(9)[2] == 0.0 and cfg.row_shares(10)[2] == 0.25


def test_the_bundled_model_continues_a_repeated_span_of_random_ids() -> None:
    """It has learned to copy: only the earlier copy predicts the second copy of random ids (chance is
    1 in 4093)."""
    from onnxgen.demo.measure import copy_accuracy, copy_probe_spans
    from onnxgen.demo.tokenizer import FIRST_ORDINARY_ID

    spans = copy_probe_spans(np.zeros(1000, dtype=np.int64), (FIRST_ORDINARY_ID, 4096), count=8)["random ids"]
    assert copy_accuracy(default_model_dir(), spans) > 0.8


def test_the_dense_demo_config_has_every_layer_full_attention_and_is_not_installable() -> None:
    from onnxgen.demo.config import DemoConfig
    from onnxgen.demo.train import _parser, config_from_args, main

    cfg = config_from_args(_parser().parse_args(["--dense", "--steps", "30", "--copy-phase-steps", "20"]))
    assert cfg.dense and cfg.total_steps == 50
    assert cfg.layer_types() == ["full_attention"] * cfg.layers
    assert cfg.text_config_kwargs()["layer_types"] == cfg.layer_types()
    hybrid = DemoConfig().layer_types()
    assert "linear_attention" in hybrid and hybrid.count("full_attention") == 2
    with pytest.raises(SystemExit):
        main(["--dense", "--install"])
