"""Memory a loaded session gives back: mapped weight pages it no longer reads, and its arena after a prefill."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from test_graph_cache import CAPACITY, PROMPT, STEPS, decode, open_session

from onnxgen.runtime import memory
from onnxgen.testing import build_model


@pytest.fixture(scope="module")
def int4_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("memory") / "m", "genai-dense", precision="int4")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps and madvise: Linux")
def test_released_file_pages_leave_the_resident_set_and_written_ones_stay(tmp_path: Path) -> None:
    folder = tmp_path / "weights"
    folder.mkdir()
    values = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    values.tofile(folder / "a.bin")
    values.tofile(folder / "b.bin")
    clean = np.memmap(folder / "a.bin", dtype=np.float32, mode="r")
    written = np.memmap(folder / "b.bin", dtype=np.float32, mode="c")  # private copy-on-write
    assert float(clean.sum()) == float(values.sum())
    written[:] += 1  # every page written: only this process has these values

    def resident() -> dict[str, int]:
        return {Path(k).name: v[1] for k, v in memory.breakdown([folder]).weights.items()}

    assert resident() == {"a.bin": values.nbytes, "b.bin": values.nbytes}
    assert memory.release_file_pages([folder]) == values.nbytes  # the clean mapping only
    assert resident() == {"a.bin": 0, "b.bin": values.nbytes}
    np.testing.assert_array_equal(clean, values)  # read back from the file
    np.testing.assert_array_equal(written, values + 1)  # the written copy is untouched


def test_releasing_a_sessions_weight_pages_mid_decode_changes_no_value(
    int4_dense: Path, cache_dir: Path
) -> None:
    session = open_session(int4_dense)
    ref = decode(session)
    state = session.new_state(CAPACITY)
    rows = list(session.forward(state, np.array([PROMPT]))[0])
    for i in range(STEPS):
        if i == STEPS // 2:
            memory.release_file_pages(session.weight_folders)
        rows.append(session.step(state, int(rows[-1].argmax())).copy())
    np.testing.assert_array_equal(np.stack(rows), ref)


def test_the_first_step_after_a_prefill_shrinks_the_arena_and_changes_no_value(
    int4_dense: Path, cache_dir: Path
) -> None:
    session = open_session(int4_dense)
    plain = open_session(int4_dense)
    plain._shrink_options = plain._run_options  # never shrinks
    long_prompt = np.array([PROMPT * 4])  # over SMALL_STEP tokens: a prefill
    state = session.new_state(40)
    session.forward(state, long_prompt, 1)
    asked = [session.step_run_options() is session._shrink_options for _ in range(2)]
    assert asked == [True, False]
    assert session._shrink_options.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
    runs = []
    for s in (session, plain):
        state = s.new_state(40)
        rows = [s.forward(state, long_prompt, 1)[0, -1]]
        for _ in range(STEPS):  # the first one shrinks (session) or not (plain)
            rows.append(s.step(state, int(rows[-1].argmax())).copy())
        runs.append(np.stack(rows))
    np.testing.assert_array_equal(runs[0], runs[1])
