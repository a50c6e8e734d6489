"""The bundled default model (the trained demo model, fp32 onnxruntime-genai export) and its tooling."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import onnxgen
from onnxgen import SamplingParams
from onnxgen.cli import main
from onnxgen.llm import default_model_dir
from tools.demo_model.measure import prefill_logits_fn

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
        "config.json",
        "mtp.safetensors",
    ):
        assert name in files
    assert sum(files.values()) <= 20_000_000
    genai = json.loads((default_model_dir() / "genai_config.json").read_text())
    assert genai["model"]["type"] == "qwen3_5_text"


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size))


def test_the_bundled_mtp_head_has_every_tensor_of_a_qwen3_5_head_in_float32() -> None:
    """mtp.safetensors holds the multi-token-prediction head in the checkpoint naming, with the shapes
    config.json's geometry gives (Linear weights are [out, in]; q_proj yields the query and a gate)."""
    text = json.loads((default_model_dir() / "config.json").read_text())["text_config"]
    assert text["mtp_num_hidden_layers"] == 1
    hidden, inter, hd = text["hidden_size"], text["intermediate_size"], text["head_dim"]
    heads, kv = text["num_attention_heads"], text["num_key_value_heads"]
    layer = "mtp.layers.0."
    want = {
        "mtp.fc.weight": [hidden, 2 * hidden],
        "mtp.pre_fc_norm_embedding.weight": [hidden],
        "mtp.pre_fc_norm_hidden.weight": [hidden],
        "mtp.norm.weight": [hidden],
        layer + "input_layernorm.weight": [hidden],
        layer + "post_attention_layernorm.weight": [hidden],
        layer + "self_attn.q_proj.weight": [heads * 2 * hd, hidden],
        layer + "self_attn.k_proj.weight": [kv * hd, hidden],
        layer + "self_attn.v_proj.weight": [kv * hd, hidden],
        layer + "self_attn.o_proj.weight": [hidden, heads * hd],
        layer + "self_attn.q_norm.weight": [hd],
        layer + "self_attn.k_norm.weight": [hd],
        layer + "mlp.gate_proj.weight": [inter, hidden],
        layer + "mlp.up_proj.weight": [inter, hidden],
        layer + "mlp.down_proj.weight": [hidden, inter],
    }
    header = _safetensors_header(default_model_dir() / "mtp.safetensors")
    header.pop("__metadata__", None)
    assert {name: entry["shape"] for name, entry in header.items()} == want
    assert {entry["dtype"] for entry in header.values()} == {"F32"}


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


def test_the_bundled_model_continues_a_repeated_span_of_random_ids() -> None:
    """It has learned to copy: only the earlier copy predicts the second copy of random ids (chance is
    1 in 4093)."""
    from tools.demo_model.measure import copy_accuracy, copy_probe_spans
    from tools.demo_model.tokenizer import FIRST_ORDINARY_ID

    spans = copy_probe_spans(np.zeros(1000, dtype=np.int64), (FIRST_ORDINARY_ID, 4096), count=8)["random ids"]
    assert copy_accuracy(default_model_dir(), spans) > 0.8
