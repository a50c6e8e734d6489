"""A plain onnxruntime loop over a tiny model: batched prefill, then one token per step, presents fed back.

It is independent of the engine on purpose: tests use it to check the fixtures themselves and as a
baseline the engine must match. Teacher-forced (the tokens fed are given, not sampled), so two exports
compared on the same tokens can never drift apart through a flipped argmax.

Port handling follows the families' names: ``past_key_values.N.key/value`` start empty
(``past_sequence_length`` 0), every other ``past*`` input is a state that starts as zeros; the present of
``past_key_values.X`` / ``past.X`` is ``present.X``. ``position_ids`` (rank 2, or rank 3 with three
identical rows) count the live tokens of each row (``cumsum(mask) - 1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import onnxruntime as ort

Padding = Literal["right", "left"]


def present_name(past: str) -> str:
    """The output that replaces input ``past`` after a step."""
    for prefix in ("past_key_values.", "past."):
        if past.startswith(prefix):
            return "present." + past[len(prefix) :]
    raise ValueError(f"input {past!r} is not a past port (expected past_key_values.* or past.*)")


def _session(model: str | Path) -> ort.InferenceSession:
    path = Path(model)
    path = path / "model.onnx" if path.is_dir() else path
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _initial_pasts(sess: ort.InferenceSession, batch: int, kv_capacity: int) -> dict[str, np.ndarray]:
    pasts = {}
    for port in sess.get_inputs():
        if not port.name.startswith("past"):
            continue
        shape = [
            batch if i == 0 else (d if isinstance(d, int) else kv_capacity) for i, d in enumerate(port.shape)
        ]
        pasts[port.name] = np.zeros(shape, dtype=np.float32)
    return pasts


def _feeds(sess: ort.InferenceSession, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    feeds = {"input_ids": ids, "attention_mask": mask}
    pos_port = next((p for p in sess.get_inputs() if p.name == "position_ids"), None)
    if pos_port is not None:
        pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -ids.shape[1] :]
        feeds["position_ids"] = np.stack([pos] * 3) if len(pos_port.shape) == 3 else pos
    return feeds


def run_teacher_forced(
    model: str | Path,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    padding: Padding = "right",
    kv_capacity: int = 0,
) -> list[np.ndarray]:
    """Prefill ``prompts`` as one padded batch, then feed ``continuations`` one token per step.

    Every continuation must have the same length. Returns, per sequence, the logits [len(prompt) +
    len(continuation), vocab] at its live positions only. ``kv_capacity`` > 0 starts every KV cache as
    a zero buffer of that many positions, as a ``past_present_share_buffer`` runtime does with
    GroupQueryAttention exports (their present then keeps that length).
    """
    if len({len(c) for c in continuations}) > 1 or len(continuations) != len(prompts):
        raise ValueError("run_teacher_forced needs one continuation per prompt, all of the same length")
    sess = _session(model)
    batch, width = len(prompts), max(len(p) for p in prompts)
    ids = np.zeros((batch, width), dtype=np.int64)
    mask = np.zeros((batch, width), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        cols = slice(0, len(prompt)) if padding == "right" else slice(width - len(prompt), width)
        ids[row, cols], mask[row, cols] = prompt, 1
    pasts = _initial_pasts(sess, batch, kv_capacity)
    names = [o.name for o in sess.get_outputs()]
    steps = [ids] + [
        np.asarray([[c[t]] for c in continuations], dtype=np.int64) for t in range(len(continuations[0]))
    ]
    logits: list[np.ndarray] = []
    for step, step_ids in enumerate(steps):
        if step:
            mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
        outs = dict(zip(names, sess.run(names, _feeds(sess, step_ids, mask) | pasts), strict=True))
        logits.append(outs["logits"])
        pasts = {name: outs[present_name(name)] for name in pasts}
    prefill_mask = mask[:, :width].astype(bool)
    return [
        np.concatenate([logits[0][row][prefill_mask[row]], *(lg[row] for lg in logits[1:])], axis=0)
        for row in range(batch)
    ]
