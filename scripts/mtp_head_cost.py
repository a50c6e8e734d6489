"""What one MTP head forward costs against a decoder step, with the head's caches warm and cold.

``python scripts/mtp_head_cost.py [MODEL_DIR] [--threads 1] [--rounds 8] [--calls 40]``

Loads the model with its head as the engine does (``load(..., speculative=True)``), runs the head over a
128-token prefix, then times single-entry head forwards (the head's cache rewound after each) in rounds
that alternate what runs just before each forward: nothing (another head forward), a decoder step, a
20 MB memory sweep (caches evicted, no onnxruntime work), a spin of one decoder step's length. A chain of
60 ``Add`` nodes on a 192-float tensor, warm and after the sweep, gives onnxruntime's cost per node with
no weights to read. Prints per-call medians in microseconds and the node counts of both graphs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

import onnxgen

PREFIX = 128


def add_chain(nodes: int) -> tuple[ort.InferenceSession, dict[str, np.ndarray]]:
    """A session of ``nodes`` chained ``Add`` nodes on one thread, and its feed."""
    names = ["x", *(f"t{i}" for i in range(1, nodes)), "y"]
    graph = helper.make_graph(
        [helper.make_node("Add", [names[i], "one"], [names[i + 1]]) for i in range(nodes)],
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 192])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 192])],
        [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])],
    )
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return session, {"x": np.ones((1, 1, 192), np.float32)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, nargs="?")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--calls", type=int, default=40)
    args = p.parse_args(argv)
    llm = onnxgen.load(args.model, threads=args.threads, speculative=True)
    head, decoder = llm.mtp_head(), llm.session
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, min(decoder.vocab_size, head.vocab_size), (1, PREFIX))
    head_state = head.new_state(PREFIX + 8)
    head.forward(head_state, prompt, rng.standard_normal((1, PREFIX, head.hidden_size)).astype(np.float32))
    steps = args.rounds * args.calls * 2 + 8
    dec_state = decoder.new_state(PREFIX + steps)
    logits = decoder.forward(dec_state, prompt, 1)[0, -1]
    hidden = rng.standard_normal((1, 1, head.hidden_size)).astype(np.float32)
    sweep = np.ones(5_000_000, np.float32)
    step_s: list[float] = []

    def step() -> None:
        nonlocal logits
        t = time.perf_counter()
        logits = decoder.step(dec_state, int(logits.argmax()))
        step_s.append(time.perf_counter() - t)

    def spin() -> None:
        end = time.perf_counter() + (statistics.median(step_s) if step_s else 0.0026)
        while time.perf_counter() < end:
            pass

    before: dict[str, Callable[[], object]] = {
        "a head forward": lambda: None,
        "a decoder step": step,
        "a 20 MB sweep": sweep.sum,
        "a spin of one step": spin,
    }
    chain, chain_feed = add_chain(60)
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, run_before in before.items():
            for _ in range(args.calls):
                run_before()
                length = head_state.length
                t = time.perf_counter()
                head.forward(head_state, np.array([[5]]), hidden)
                times.setdefault(f"head forward after {name}", []).append(time.perf_counter() - t)
                head_state.rewind(length)
        for cold in (False, True):
            for _ in range(args.calls):
                if cold:
                    sweep.sum()
                t = time.perf_counter()
                chain.run(None, chain_feed)
                times.setdefault(f"60 Add nodes {'after a sweep' if cold else 'warm'}", []).append(
                    time.perf_counter() - t
                )
    print(f"{args.threads} thread(s), head cache {PREFIX} entries; per-call medians")
    print(f"  decoder step: {statistics.median(step_s) * 1e6:.0f} us")
    for name, values in times.items():
        print(f"  {name}: {statistics.median(values) * 1e6:.0f} us")
    for label, prepared in (("head", head.session.prepared), ("decoder", decoder.prepared)):
        source = prepared.source()[0]
        graph = (
            onnx.load_model_from_string(source)
            if isinstance(source, bytes)
            else onnx.load(source, load_external_data=False)
        )
        print(
            f"  {label} graph: {len(graph.graph.node)} nodes (the prepared graph, before onnxruntime's own fusions)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
