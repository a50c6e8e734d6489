"""Decode states of one DecoderSession run on several threads at once give what they give alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from runtime_helpers import PROMPT, teacher_forced

from onnxgen.runtime.session import DecoderSession

THREADS = 4
STEPS = [(11 * i + 5 * j) % 300 + 3 for j in range(THREADS) for i in range(40)]


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai", "hybrid-mobius"])
def test_states_run_on_parallel_threads_get_their_own_logits(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    session = sessions[family]
    runs = [STEPS[40 * j : 40 * (j + 1)] for j in range(THREADS)]
    alone = [teacher_forced(session, session.new_state(64), PROMPT, run) for run in runs]
    together: list[np.ndarray | None] = [None] * THREADS

    def work(j: int) -> None:
        together[j] = teacher_forced(session, session.new_state(64), PROMPT, runs[j])

    threads = [threading.Thread(target=work, args=(j,)) for j in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for j in range(THREADS):
        np.testing.assert_array_equal(together[j], alone[j], err_msg=f"thread {j}")
