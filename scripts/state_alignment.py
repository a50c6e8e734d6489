"""What a misaligned recurrent state costs onnxruntime's hybrid kernels: one node, two placements.

``python scripts/state_alignment.py [--tokens 1,512] [--threads 1] [--rounds 9]``

Runs one ``LinearAttention`` (gated delta rule, 16 heads of 128, the Qwen3.5-0.8B layout) and one
``CausalConvWithState`` (6144 channels, kernel 4) over ``T`` tokens, with the past and present state
bound in place, first at a 64-byte boundary (what onnxgen binds, and what onnxruntime's allocator
returns), then 16 bytes past one (where numpy puts a large array). Inputs and outputs other than the
states sit on the boundary in both. Placements take turns; prints the medians of the rounds and the
median of the per-round ratios (> 1: the misaligned state is slower).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from onnxgen.runtime.buffers import aligned_zeros

HEADS, HEAD_DIM, CHANNELS, KERNEL = 16, 128, 6144, 4


def placed(shape: tuple[int, ...], skew: int) -> np.ndarray:
    """Zeros of float32 ``skew`` bytes past a 64-byte boundary (onnxgen's own aligned allocation, shifted)."""
    nbytes = int(np.prod(shape)) * 4
    return aligned_zeros((nbytes + skew,), np.uint8)[skew:].view(np.float32).reshape(shape)


def graph(op: str, tokens: int) -> tuple[bytes, dict[str, np.ndarray], tuple[int, ...], tuple[int, ...]]:
    """The one-node model, its inputs other than the state, the state's shape and the output's shape."""
    rng = np.random.default_rng(0)
    f = TensorProto.FLOAT
    width = HEADS * HEAD_DIM
    if op == "LinearAttention":
        node = helper.make_node(
            op, ["q", "k", "v", "past", "decay", "beta"], ["out", "present"], domain="com.microsoft",
            q_num_heads=HEADS, kv_num_heads=HEADS, update_rule="gated_delta", scale=1.0,
        )  # fmt: skip
        feeds = {
            "q": rng.standard_normal((1, tokens, width)).astype(np.float32) * 0.1,
            "k": rng.standard_normal((1, tokens, width)).astype(np.float32) * 0.1,
            "v": rng.standard_normal((1, tokens, width)).astype(np.float32),
            "decay": np.full((1, tokens, HEADS), 0.9, np.float32),
            "beta": np.full((1, tokens, HEADS), 0.5, np.float32),
        }
        state, out, inits = (1, HEADS, HEAD_DIM, HEAD_DIM), (1, tokens, width), []
    else:
        node = helper.make_node(
            op, ["x", "w", "b", "past"], ["out", "present"], domain="com.microsoft", ndim=1, activation="silu"
        )
        weight = rng.standard_normal(CHANNELS * KERNEL).astype(np.float32) * 0.1
        inits = [
            helper.make_tensor("w", f, [CHANNELS, 1, KERNEL], weight),
            helper.make_tensor("b", f, [CHANNELS], np.zeros(CHANNELS, np.float32)),
        ]
        feeds = {"x": rng.standard_normal((1, CHANNELS, tokens)).astype(np.float32)}
        state, out = (1, CHANNELS, KERNEL - 1), (1, CHANNELS, tokens)
    inputs = [helper.make_tensor_value_info(n, f, list(a.shape)) for n, a in feeds.items()]
    inputs.append(helper.make_tensor_value_info("past", f, list(state)))
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("out", "present")]
    model = helper.make_model(
        helper.make_graph([node], op, inputs, outputs, inits),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    return model.SerializeToString(), feeds, state, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,512")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    for tokens in (int(t) for t in args.tokens.split(",")):
        repeats = max(3, 400 // tokens)
        for op in ("LinearAttention", "CausalConvWithState"):
            model, feeds, state, out = graph(op, tokens)
            session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
            bindings, keep = {}, []
            for skew in (0, 16):
                binding = session.io_binding()
                arrays = {n: placed(a.shape, 0) for n, a in feeds.items()}
                for n, a in feeds.items():
                    arrays[n][...] = a
                arrays |= {"past": placed(state, skew), "present": placed(state, skew), "out": placed(out, 0)}
                for n in (*feeds, "past"):
                    binding.bind_ortvalue_input(n, ort.OrtValue.ortvalue_from_numpy(arrays[n]))
                for n in ("out", "present"):
                    binding.bind_ortvalue_output(n, ort.OrtValue.ortvalue_from_numpy(arrays[n]))
                keep.append(arrays)
                for _ in range(3):
                    session.run_with_iobinding(binding)
                bindings[skew] = binding
            times: dict[int, list[float]] = {0: [], 16: []}
            for r in range(args.rounds):
                for skew in (0, 16) if r % 2 == 0 else (16, 0):
                    start = time.perf_counter()
                    for _ in range(repeats):
                        session.run_with_iobinding(bindings[skew])
                    times[skew].append((time.perf_counter() - start) / repeats * 1e6)
            ratio = statistics.median(b / a for a, b in zip(times[0], times[16], strict=True))
            print(
                f"{op:20} {tokens:4} tokens, {args.threads} thread(s): aligned {statistics.median(times[0]):9.0f} us,"
                f" 16 bytes past {statistics.median(times[16]):9.0f} us, past / aligned {ratio:.3f}"
            )


if __name__ == "__main__":
    main()
