"""The server's step trace (``ONNXGEN_STEP_TRACE``): every forward of the served requests, and nothing without it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from onnxgen import SamplingParams, load
from onnxgen.server.metrics import ServerMetrics
from onnxgen.server.scheduler import Scheduler, SchedulerConfig
from onnxgen.server.sequence import Delta, Handle, Job, SequenceRun
from onnxgen.testing import build_model

PROMPTS = ([5, 9, 13], [7, 3, 11, 2, 8])
NEW_TOKENS = 4


def serve(model: Path, prompts: tuple[list[int], ...]) -> list[list[int]]:
    """Serve ``prompts`` at once through a server worker; each one's tokens."""
    llm = load(model, threads=1)
    assert llm.tokenizer is not None
    config = SchedulerConfig(max_batch=4, max_queue=4, max_model_len=64)
    scheduler = Scheduler(llm, config, ServerMetrics())
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    tokens: list[list[int]] = [[] for _ in prompts]
    finished = threading.Semaphore(0)

    def job(i: int, prompt: list[int]) -> Job:
        def push(deltas: list[Delta]) -> None:
            tokens[i].extend(d.token_id for d in deltas)
            if any(d.finish_reason is not None for d in deltas):
                finished.release()

        return Job(Handle(push), prompt, [SequenceRun(0, prompt, params, llm.eos_token_ids, llm.tokenizer)])

    scheduler.start()
    try:
        scheduler.submit([job(i, p) for i, p in enumerate(prompts)])
        for _ in prompts:
            assert finished.acquire(timeout=60), "a request was not served"
    finally:
        scheduler.stop()
    return tokens


def test_the_trace_holds_every_forward_and_the_output_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_model(tmp_path / "m", "genai-dense")
    plain = serve(model, PROMPTS)
    assert not list(tmp_path.glob("*.jsonl"))  # without the variable nothing is written
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("ONNXGEN_STEP_TRACE", str(trace))
    assert serve(model, PROMPTS) == plain
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    forwards = [f for r in records for f in r["fw"]]
    prefilled = sum(rows * tokens for phase, rows, tokens, _ in forwards if phase == "prefill")
    assert prefilled == sum(len(p) for p in PROMPTS)
    # each request's first token comes from its prompt's forward, the others from decode steps
    decoded = sum(rows for phase, rows, tokens, _ in forwards if phase == "decode")
    assert decoded == len(PROMPTS) * (NEW_TOKENS - 1)
    for r in records:
        forward_s = sum(f[3] for f in r["fw"])
        assert 0 <= forward_s + r["copy"] <= r["step"] + 1e-6
        assert r["idle"] >= 0 and r["take"] >= 0 and r["push"] >= 0
    assert records[-1]["rows"] == 0 and records[-1]["jobs"] == 0
    assert max(r["rows"] for r in records) == len(PROMPTS)  # both decoded together
