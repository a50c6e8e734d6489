"""The cost of onnxruntime's int4 MatMulNBits kernel per row: a minimal graph, no model around it.

``python scripts/matmulnbits_rows.py [--threads 2] [--rows 1,2,4,8,16,64] [--layers 16] [--hidden 1024]
[--inner 3584] [--rounds 5]``

Builds chains of ``--layers`` pairs of projections (hidden -> inner -> hidden, the shape of an MLP without
its activation; random weights, ~``layers * 2 * hidden * inner`` parameters, more than a CPU cache holds) in
three forms: int4 ``MatMulNBits`` (block 32) with ``accuracy_level`` 4 (activations quantized to int8)
and 1 (fp32 activations), and plain fp32 ``MatMul``. Each runs on ``M`` rows of input for every ``M`` in
``--rows`` (forms and row counts take turns; medians over rounds), and prints the forward's milliseconds,
the milliseconds per row and the cost against one row. A memory-bound kernel costs about the same for 8 rows
as for one (the weights are read once); a compute-bound one costs about 8 times as much.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

BLOCK = 32


def int4_weights(rng: np.random.Generator, k: int, n: int, name: str) -> list[onnx.TensorProto]:
    packed = rng.integers(0, 256, size=(n, k // BLOCK, BLOCK // 2), dtype=np.uint8)
    scales = (rng.random(n * (k // BLOCK), dtype=np.float32) * 0.02).astype(np.float32)
    return [numpy_helper.from_array(packed, f"{name}_q"), numpy_helper.from_array(scales, f"{name}_s")]


def chain(form: str, layers: int, hidden: int, inner: int, seed: int = 0) -> bytes:
    """The graph of ``form`` ("int4-acc4", "int4-acc1" or "fp32") as serialized bytes."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    x = "x"
    for i in range(2 * layers):
        k, n = (hidden, inner) if i % 2 == 0 else (inner, hidden)
        name, out = f"w{i}", f"h{i}"
        if form == "fp32":
            w = (rng.standard_normal((k, n), dtype=np.float32) * (1 / np.sqrt(k))).astype(np.float32)
            inits.append(numpy_helper.from_array(w, name))
            nodes.append(helper.make_node("MatMul", [x, name], [out]))
        else:
            level = 4 if form == "int4-acc4" else 1
            inits += int4_weights(rng, k, n, name)
            nodes.append(
                helper.make_node(
                    "MatMulNBits",
                    [x, f"{name}_q", f"{name}_s"],
                    [out],
                    domain="com.microsoft",
                    K=k,
                    N=n,
                    bits=4,
                    block_size=BLOCK,
                    accuracy_level=level,
                )
            )
        x = out
    graph = helper.make_graph(
        nodes,
        form,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", hidden])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["M", hidden])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    return model.SerializeToString()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,8,16,64")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inner", type=int, default=3584)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5, help="forwards timed per row count and round")
    p.add_argument("--forms", default="int4-acc4,int4-acc1,fp32")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    forms = args.forms.split(",")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    opts.inter_op_num_threads = 1
    sessions = {
        f: ort.InferenceSession(
            chain(f, args.layers, args.hidden, args.inner), opts, ["CPUExecutionProvider"]
        )
        for f in forms
    }
    inputs = {m: np.random.default_rng(m).standard_normal((m, args.hidden), dtype=np.float32) for m in rows}
    times: dict[tuple[str, int], list[float]] = {(f, m): [] for f in forms for m in rows}
    for f in forms:  # warm up (prepacking, first-run allocations)
        for m in rows:
            sessions[f].run(None, {"x": inputs[m]})
    for _ in range(args.rounds):
        for f in forms:
            for m in rows:
                runs = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    sessions[f].run(None, {"x": inputs[m]})
                    runs.append(time.perf_counter() - start)
                times[(f, m)].append(statistics.median(runs))
    params = args.layers * 2 * args.hidden * args.inner
    print(
        f"{args.layers} x ({args.hidden} -> {args.inner} -> {args.hidden}) projections, {params / 1e6:.0f}M "
        f"parameters, {args.threads} threads, medians of {args.rounds} rounds x {args.repeats} forwards"
    )
    print(f"{'form':>10} {'rows':>5} {'forward ms':>11} {'ms/row':>8} {'vs 1 row':>9}")
    for f in forms:
        one = statistics.median(times[(f, rows[0])])
        for m in rows:
            t = statistics.median(times[(f, m)])
            print(f"{f:>10} {m:5d} {t * 1e3:11.2f} {t * 1e3 / m:8.2f} {t / one:8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
