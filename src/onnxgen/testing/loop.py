"""A plain onnxruntime loop over a tiny model: batched prefill, then one token per step, presents fed back.

It is independent of the engine on purpose: tests use it to check the fixtures themselves and as a
baseline the engine must match. Teacher-forced (the tokens fed are given, not sampled), so two exports
compared on the same tokens can never drift apart through a flipped argmax.

Port handling follows the families' names: KV inputs (``past_key_values.N.key/value``, stacked ``past_N``)
start empty (``past_sequence_length`` 0), every other ``past*`` input is a state that starts as zeros; the
present of ``past_key_values.X`` / ``past.X`` / ``past_X`` is ``present.X`` / ``present_X``. Static caches
(``key_cache.N`` -> ``updated_key_cache.N``) start as zero buffers and are fed ``write_indices`` (each row's
live length) and ``nonpad_kv_seqlen`` (that plus the tokens of the step); their batches must be
right-padded. ``position_ids`` (rank 2, or rank 3 with three identical rows) count the live tokens of each
row (``cumsum(mask) - 1``). Every index input takes the integer type the graph declares.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import onnxruntime as ort

Padding = Literal["right", "left"]
_STATIC = ("key_cache.", "value_cache.")


def present_name(past: str) -> str:
    """The output that replaces input ``past`` after a step."""
    if past.startswith(_STATIC):
        return "updated_" + past
    for prefix in ("past_key_values.", "past.", "past_"):
        if past.startswith(prefix):
            return ("present_" if prefix == "past_" else "present.") + past[len(prefix) :]
    raise ValueError(
        f"input {past!r} is not a past port (expected past_key_values.*, past.*, past_N or *_cache.N)"
    )


def _session(model: str | Path) -> ort.InferenceSession:
    path = Path(model)
    path = path / "model.onnx" if path.is_dir() else path
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _initial_pasts(sess: ort.InferenceSession, batch: int, kv_capacity: int) -> dict[str, np.ndarray]:
    pasts = {}
    for port in sess.get_inputs():
        if not port.name.startswith(("past", *_STATIC)):
            continue
        shape = [d if isinstance(d, int) else batch if "batch" in str(d) else kv_capacity for d in port.shape]
        pasts[port.name] = np.zeros(shape, dtype=np.float32)
    return pasts


def _feeds(sess: ort.InferenceSession, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    ports = {p.name: p for p in sess.get_inputs()}

    def typed(name: str, value: np.ndarray) -> np.ndarray:
        return value.astype(np.int32 if ports[name].type == "tensor(int32)" else np.int64)

    feeds = {"input_ids": typed("input_ids", ids)}
    if "attention_mask" in ports:
        feeds["attention_mask"] = typed("attention_mask", mask)
    pos_port = ports.get("position_ids")
    if pos_port is not None:
        pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -ids.shape[1] :]
        feeds["position_ids"] = typed(
            "position_ids", np.stack([pos] * 3) if len(pos_port.shape) == 3 else pos
        )
    if "write_indices" in ports:  # a static cache
        if ids.shape[1] == 1:  # a step: each right-padded row writes at its own length
            live = mask.sum(axis=1)
            write, lengths = live - 1, live
        else:  # the prefill writes every column; a live query never reaches a pad column
            write, lengths = np.zeros(len(ids), np.int64), np.full(len(ids), ids.shape[1], np.int64)
        feeds["write_indices"] = typed("write_indices", write)
        feeds["nonpad_kv_seqlen"] = typed("nonpad_kv_seqlen", lengths)
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
    static = any(p.name == "write_indices" for p in sess.get_inputs())
    if static and padding != "right":
        raise ValueError("a static cache writes each row at its length: prefill it right-padded")
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
