"""What admitting a prefilled sequence into a batch row costs: ``BatchState.admit`` (one copy, from views of
the prefill state's buffers) beside the two-copy admission it replaced (arrays copied out of the state,
then into the row), in turn.

``python scripts/admit_cost.py MODEL_DIR [--prompt 64] [--rounds 4] [--threads 2]``

Each round opens a fresh 8-row batch per variant and fills it three times (retiring every row between):
the first fill writes each row for the first time, the other two are what a running server pays. Prints
the median admission of each kind. Shared-KV exports only (GroupQueryAttention with in-place caches).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from onnxgen import load
from onnxgen.runtime.batch import BatchState, rows_first
from onnxgen.runtime.state import DecodeState


def admit_two_copies(batch: BatchState, state: DecodeState) -> None:
    """The previous admission: every array copied out of ``state``, then into row ``batch.n``."""
    row, length = batch.n, state.length
    kv = state.kv_arrays()
    for name, buf, pair in zip(batch._kv_in, batch._kv_shared, batch._kv_pairs, strict=True):
        rows_first(buf.array, pair)[row, :length] = rows_first(kv[name], pair)[0]
    states = state.state_arrays()
    for name, buf in zip(batch._state_in, batch._states, strict=True):
        buf.array[row] = states[name][0]
    batch.lengths[row] = length
    batch.n += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    session = load(args.model, threads=args.threads).session
    if not session.io.kv_in_place:
        raise SystemExit("this export's KV grows with each step; the comparison covers shared-KV exports")
    state = session.new_state(2048)
    session.forward(state, np.arange(100, 100 + args.prompt)[None], 1)
    steady: dict[str, list[float]] = {"two copies": [], "one copy": []}
    first: dict[str, list[float]] = {"two copies": [], "one copy": []}
    for r in range(args.rounds):
        for kind in list(steady)[:: 1 if r % 2 == 0 else -1]:
            batch = BatchState(session, 8, 2048)
            for fill in range(3):
                for _ in range(8):
                    start = time.perf_counter()
                    admit_two_copies(batch, state) if kind == "two copies" else batch.admit(state)
                    (steady if fill else first)[kind].append(time.perf_counter() - start)
                while batch.n:
                    batch.retire(batch.n - 1)
    for kind in steady:
        print(
            f"admission, {kind}: {statistics.median(steady[kind]) * 1000:.1f} ms (median of "
            f"{len(steady[kind])}), first write to a row {statistics.median(first[kind]) * 1000:.1f} ms"
        )


if __name__ == "__main__":
    main()
