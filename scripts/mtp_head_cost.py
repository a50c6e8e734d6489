"""What one MTP head forward costs against a decoder step, with the head's caches warm and cold.

``python scripts/mtp_head_cost.py [MODEL_DIR ...] [--threads 1] [--rounds 8] [--calls 40]``

Loads each model with its head as the engine does (``load(..., speculative=True)``), runs the head over a
128-token prefix, then times single-entry head forwards (the head's cache rewound after each) in rounds
(every model in every round, so several heads are compared interleaved) that alternate what runs just
before each forward: nothing (another head forward), a decoder step, a
20 MB memory sweep (caches evicted, no onnxruntime work), a spin of one decoder step's length. A chain of
60 ``Add`` nodes on a 192-float tensor, warm and after the sweep, gives onnxruntime's cost per node with
no weights to read. Prints per-call medians in microseconds and the node counts of both graphs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

import onnxgen
from onnxgen.runtime.mtp_head import MTPHeadSession
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState

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


@dataclass
class Subject:
    """One loaded model: its head over a 128-entry cache and its decoder, stepping greedily."""

    label: str
    head: MTPHeadSession
    head_state: DecodeState
    decoder: DecoderSession
    decoder_state: DecodeState
    logits: np.ndarray
    step_s: list[float] = field(default_factory=list)

    @classmethod
    def load(cls, model: Path | None, threads: int, steps: int) -> Subject:
        llm = onnxgen.load(model, threads=threads, speculative=True)
        head, decoder = llm.mtp_head(), llm.session
        rng = np.random.default_rng(0)
        prompt = rng.integers(1, min(decoder.vocab_size, head.vocab_size), (1, PREFIX))
        head_state = head.new_state(PREFIX + 8)
        hidden = rng.standard_normal((1, PREFIX, head.hidden_size)).astype(np.float32)
        head.forward(head_state, prompt, hidden)
        decoder_state = decoder.new_state(PREFIX + steps)
        logits = decoder.forward(decoder_state, prompt, 1)[0, -1]
        return cls(str(model or "bundled"), head, head_state, decoder, decoder_state, logits)

    def step(self) -> None:
        t = time.perf_counter()
        self.logits = self.decoder.step(self.decoder_state, int(self.logits.argmax()))
        self.step_s.append(time.perf_counter() - t)

    def spin(self) -> None:
        end = time.perf_counter() + (statistics.median(self.step_s) if self.step_s else 0.0026)
        while time.perf_counter() < end:
            pass

    def graph_nodes(self) -> dict[str, int]:
        """Node counts of the prepared graphs (before onnxruntime's own fusions)."""
        out = {}
        for label, prepared in (("head", self.head.session.prepared), ("decoder", self.decoder.prepared)):
            source = prepared.source()[0]
            graph = (
                onnx.load_model_from_string(source)
                if isinstance(source, bytes)
                else onnx.load(source, load_external_data=False)
            )
            out[label] = len(graph.graph.node)
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", type=Path, nargs="*", help="model directories (default: the bundled model)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--calls", type=int, default=40)
    args = p.parse_args(argv)
    steps = args.rounds * args.calls * 2 + 8
    subjects = [Subject.load(m, args.threads, steps) for m in args.models or [None]]
    hidden = np.random.default_rng(1).standard_normal((1, 1, subjects[0].head.hidden_size)).astype(np.float32)
    sweep = np.ones(5_000_000, np.float32)
    chain, chain_feed = add_chain(60)
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for s in subjects:  # interleaved: every model's calls in every round
            before: dict[str, Callable[[], object]] = {
                "a head forward": lambda: None,
                "a decoder step": s.step,
                "a 20 MB sweep": sweep.sum,
                "a spin of one step": s.spin,
            }
            for name, run_before in before.items():
                for _ in range(args.calls):
                    run_before()
                    length = s.head_state.length
                    t = time.perf_counter()
                    s.head.forward(s.head_state, np.array([[5]]), hidden)
                    times.setdefault((s.label, f"head forward after {name}"), []).append(
                        time.perf_counter() - t
                    )
                    s.head_state.rewind(length)
        for cold in (False, True):
            for _ in range(args.calls):
                if cold:
                    sweep.sum()
                t = time.perf_counter()
                chain.run(None, chain_feed)
                times.setdefault(("-", f"60 Add nodes {'after a sweep' if cold else 'warm'}"), []).append(
                    time.perf_counter() - t
                )
    print(f"{args.threads} thread(s), head cache {PREFIX} entries; per-call medians")
    for s in subjects:
        nodes = s.graph_nodes()
        print(f"{s.label}: head graph {nodes['head']} nodes, decoder {nodes['decoder']}")
        print(f"  decoder step: {statistics.median(s.step_s) * 1e6:.0f} us")
        for (label, name), values in times.items():
            if label == s.label:
                print(f"  {name}: {statistics.median(values) * 1e6:.0f} us")
    for (label, name), values in times.items():
        if label == "-":
            print(f"{name}: {statistics.median(values) * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
