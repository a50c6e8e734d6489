"""The server's worker over the engine: a job the engine refuses fails alone, the others are served."""

from __future__ import annotations

import threading
from pathlib import Path

from onnxgen import SamplingParams, load
from onnxgen.server.metrics import ServerMetrics
from onnxgen.server.scheduler import Scheduler, SchedulerConfig
from onnxgen.server.sequence import Delta, Handle, Job, SequenceRun
from onnxgen.testing import build_model


def test_a_job_the_engine_refuses_fails_alone(tmp_path: Path) -> None:
    llm = load(build_model(tmp_path / "m", "genai-dense"), threads=1)
    assert llm.tokenizer is not None
    scheduler = Scheduler(llm, SchedulerConfig(max_batch=1, max_queue=4, max_model_len=64), ServerMetrics())
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    got: dict[str, list[Delta]] = {"wide": [], "ok": []}
    done = threading.Event()

    def job(name: str, choices: int) -> Job:
        def push(deltas: list[Delta]) -> None:
            got[name].extend(deltas)
            if name == "ok" and any(d.finish_reason is not None for d in deltas):
                done.set()

        prompt = [5, 9, 13]
        runs = [SequenceRun(i, prompt, params, llm.eos_token_ids, llm.tokenizer) for i in range(choices)]
        return Job(Handle(push), prompt, runs)

    scheduler.start()
    try:
        scheduler.submit([job("wide", 2), job("ok", 1)])  # 2 choices cannot fit a batch of 1 row
        assert done.wait(60), "the other job was not served"
    finally:
        scheduler.stop()
    assert [d.finish_reason for d in got["wide"]] == ["error", "error"]
    assert "exceed the batch of 1 rows" in str(got["wide"][0].error)
    assert [d.token_id for d in got["ok"]] == llm.generate([5, 9, 13], params).token_ids
