"""What the exact (serial-attention) verify costs: decode steps and verifies on the graph as exported
against the serialized graph, in one process, rounds interleaved.

    python scripts/serial_verify_cost.py MODEL_DIR [--width 5] [--threads 2] [--rounds 15] [--past 64,512]

For each past length prints the median time of a decode step and of a ``width``-token verify on both
graphs and their ratio (serialized / as exported): the decode step pays one ``If`` per attention layer,
the verify runs its attention position by position.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from onnxgen.model import ModelPackage
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--width", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--past", default="64,512")
    args = p.parse_args()
    package = ModelPackage.open(args.model)
    graph = session_graph(package.model_path, package.io)
    plain = DecoderSession(graph, threads=args.threads)
    serial = DecoderSession(graph, threads=args.threads)
    if serial.serialize_verifies(args.width) is None:
        raise SystemExit("the serial-attention rewrite does not apply to this model")
    vocab = plain.vocab_size
    for past in (int(x) for x in args.past.split(",")):
        prompt = np.array([[(7 * i + 3) % vocab for i in range(past)]], dtype=np.int64)
        drafts = np.array([[(11 * i + 5) % vocab for i in range(args.width)]], dtype=np.int64)
        times: dict[str, list[float]] = {
            k: [] for k in ("step plain", "step serial", "verify plain", "verify serial")
        }
        states = {}
        for name, session in (("plain", plain), ("serial", serial)):
            state = session.new_state(past + args.width + 64)
            session.forward(state, prompt, 1)
            states[name] = (session, state)
        for _ in range(args.rounds):
            for name, (session, state) in states.items():
                snap = state.snapshot()  # (a hybrid's states cannot be rewound by length)
                t = time.perf_counter()
                for k in range(8):
                    session.step(state, 100 + k)
                times[f"step {name}"].append((time.perf_counter() - t) / 8)
                t = time.perf_counter()
                session.forward(state, drafts, args.width)
                times[f"verify {name}"].append(time.perf_counter() - t)
                state.restore(snap)
                state.release(snap)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(
            f"past {past}: step {med['step plain']:.2f} / {med['step serial']:.2f} ms "
            f"({med['step serial'] / med['step plain']:.3f}x), {args.width}-token verify "
            f"{med['verify plain']:.2f} / {med['verify serial']:.2f} ms "
            f"({med['verify serial'] / med['verify plain']:.3f}x)  [as exported / serialized]"
        )


if __name__ == "__main__":
    main()
