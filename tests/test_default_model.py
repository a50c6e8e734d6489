"""The bundled default model (the trained demo model, fp32 onnxruntime-genai export) and its tooling."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import onnxgen
from onnxgen import MTP, SamplingParams
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
        "mtp.onnx",
        "mtp.onnx.data",
    ):
        assert name in files
    assert sum(files.values()) <= 20_000_000
    genai = json.loads((default_model_dir() / "genai_config.json").read_text())
    assert genai["model"]["type"] == "qwen3_5_text"


# Ordinary Python the bundled model has not seen (not a standard library file).
UNSEEN_CODE = (
    'import json\nfrom pathlib import Path\n\n\ndef load_settings(path):\n    """Read a JSON settings file."""\n',
    "class Queue:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n",
)


@pytest.fixture(scope="module")
def speculative_llm() -> onnxgen.LLM:
    return onnxgen.load(threads=1, speculative=True)


def _mtp_run(llm: onnxgen.LLM, prompt: str, drafts: int) -> Any:
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    return llm.generate(prompt, params, speculative=MTP(num_draft_tokens=drafts, auto=False))


def test_greedy_mtp_speculation_with_the_bundled_head_emits_plain_greedys_tokens(
    speculative_llm: onnxgen.LLM,
) -> None:
    """The bundled mtp.onnx drafts, the model verifies: the same tokens as plain greedy decoding, with
    drafts both accepted and rejected (so verification decided something)."""
    accepted = proposed = 0
    for prompt in UNSEEN_CODE:
        plain = speculative_llm.generate(prompt, SamplingParams(max_new_tokens=48, ignore_eos=True))
        result = _mtp_run(speculative_llm, prompt, 3)
        assert result.token_ids == plain.token_ids, prompt
        accepted += result.stats["accepted_draft_tokens"]
        proposed += result.stats["proposed_draft_tokens"]
    assert 0 < accepted < proposed, f"{accepted}/{proposed}"


def _shuffle_external_tensor(model_dir: Path, onnx_file: str, name_part: str) -> None:
    """Shuffle, in place, the stored bytes of the first initializer of ``onnx_file`` whose name contains
    ``name_part`` (kept in an external data file of ``model_dir``)."""
    import onnx

    graph = onnx.load(str(model_dir / onnx_file), load_external_data=False).graph
    tensor = next(t for t in graph.initializer if name_part in t.name and t.external_data)
    info = {e.key: e.value for e in tensor.external_data}
    offset, length = int(info.get("offset", 0)), int(info["length"])
    path = model_dir / info["location"]
    data = bytearray(path.read_bytes())
    chunk = np.frombuffer(bytes(data[offset : offset + length]), dtype=np.uint8)
    data[offset : offset + length] = np.random.default_rng(0).permutation(chunk).tobytes()
    path.write_bytes(bytes(data))


def test_the_bundled_head_is_trained_its_drafts_mostly_accepted_and_a_scrambled_head_mostly_rejected(
    speculative_llm: onnxgen.LLM, tmp_path: Path
) -> None:
    """One draft a step on unseen code: the trained head's draft is the model's own greedy token after
    next most of the time. The same head with its fc weights scrambled is rarely right: the acceptance
    comes from the trained weights, not from the speculation loop."""
    import shutil

    def acceptance(llm: onnxgen.LLM) -> float:
        runs = [_mtp_run(llm, prompt, 1) for prompt in UNSEEN_CODE]
        accepted = sum(r.stats["accepted_draft_tokens"] for r in runs)
        return accepted / sum(r.stats["proposed_draft_tokens"] for r in runs)

    trained = acceptance(speculative_llm)
    scrambled_dir = Path(shutil.copytree(default_model_dir(), tmp_path / "model"))
    _shuffle_external_tensor(scrambled_dir, "mtp.onnx", "fc")
    scrambled = acceptance(onnxgen.load(scrambled_dir, threads=1, speculative=True))
    assert trained > 0.4, trained
    assert scrambled < trained / 3, (scrambled, trained)


def test_inspect_reports_a_hybrid_with_state_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(default_model_dir()), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["family"].startswith("hybrid")
    assert out["mtp_head"].startswith("mtp.onnx")
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
