"""CPU seconds of the imports a load needs (``import onnxgen, onnxgen.llm``), in fresh processes.

``python scripts/import_time.py PYTHONPATH [PYTHONPATH ...] [--runs 7]``

Each PYTHONPATH is one case (an onnxgen source tree, optionally behind a folder with other package
versions, e.g. ``/tmp/ml_dtypes-0.6:src``); the cases alternate, ``--runs`` rounds. Prints each case's median
CPU seconds (user + system of the finished process, which a busy machine disturbs less than wall time)
and median wall seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="one PYTHONPATH per case")
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args(argv)
    cpu: dict[str, list[float]] = {path: [] for path in args.paths}
    wall: dict[str, list[float]] = {path: [] for path in args.paths}
    for _ in range(args.runs):
        for path in args.paths:
            start = time.perf_counter()
            proc = subprocess.Popen(
                [sys.executable, "-c", "import onnxgen, onnxgen.llm"], env={**os.environ, "PYTHONPATH": path}
            )
            _, status, usage = os.wait4(proc.pid, 0)
            if status:
                raise SystemExit(f"the import failed with PYTHONPATH={path}")
            wall[path].append(time.perf_counter() - start)
            cpu[path].append(usage.ru_utime + usage.ru_stime)
    for path in args.paths:
        print(
            f"{path}: CPU s {statistics.median(cpu[path]):.2f}  wall s {statistics.median(wall[path]):.2f}  "
            f"(median of {args.runs})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
