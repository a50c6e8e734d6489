"""BatchLimits: an :class:`~onnxgen.config.EngineConfig`'s batch settings resolved against a loaded model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxgen.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from onnxgen.errors import SettingError
from onnxgen.model import ModelPackage
from onnxgen.model.io import DecoderIO
from onnxgen.runtime import memory
from onnxgen.runtime.batch import invariant_min_rows
from onnxgen.runtime.buffers import dtype_of
from onnxgen.runtime.session import DecoderSession


@dataclass(frozen=True)
class BatchLimits:
    """How many sequences decode together and how much may wait.

    Attributes:
        max_batch: batch rows, i.e. sequences decoded together.
        max_queue: prompts that may wait for a row before new requests are refused.
        max_model_len: tokens per row (prompt + generated).
        prefill_chunk: prompt tokens per prefill forward (also the budget between two decode steps); at
            least 2, so that no prefill forward but a one-token prompt's runs the single-token path.
        min_rows: every decode step runs at least this many rows (idle ones pad it), so that kernels
            that compute one row differently from several (int4 MatMulNBits on this CPU)
            give a sequence the same tokens whether it decodes alone or beside others.
        batch_prefill: prefill equal-length prompts of one iteration as one multi-row forward
            (:mod:`onnxgen.engine.scheduler`).
    """

    max_batch: int = 16
    max_queue: int = 64
    max_model_len: int = 2048
    prefill_chunk: int = 512
    min_rows: int = 1
    batch_prefill: bool = False

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_queue", "max_model_len", "prefill_chunk", "min_rows"):
            value, least = getattr(self, name), 2 if name in ("max_model_len", "prefill_chunk") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise SettingError(f"{name} must be an integer >= {least} (got {value!r})")

    @classmethod
    def resolve(cls, config: EngineConfig, package: ModelPackage, session: DecoderSession) -> BatchLimits:
        """``config``'s limits, where it leaves them open: the model's context, cut to what
        :func:`kv_budget_bytes` holds for ``max_batch`` rows (:func:`default_max_model_len`), and the
        ``min_rows`` this CPU's kernels need (probed on ``session``)."""
        context = package.context_length
        max_len = config.max_model_len or default_max_model_len(package.io, context, config.max_batch)[0]
        if context is not None and max_len > context:
            raise SettingError(
                f"max_model_len {max_len} exceeds the model's context of {context} tokens; lower it"
            )
        min_rows = config.min_rows
        if min_rows is None:
            min_rows = invariant_min_rows(package.graph, session)
            package.release_graph()  # read again for that probe only
        return cls(
            config.max_batch, config.max_queue, max_len, config.prefill_chunk, min_rows, config.batch_prefill
        )


# The share of the memory available at load that the batch's KV caches and states may take by default.
KV_BUDGET_SHARE = 0.25


def kv_budget_bytes() -> int | None:
    """What the batch's KV caches and recurrent states may take when ``max_model_len`` is not given:
    ``KV_BUDGET_SHARE`` of the memory available now (None where it cannot be read)."""
    available = memory.available_bytes()
    return None if available is None else int(available * KV_BUDGET_SHARE)


def row_bytes(io: DecoderIO) -> tuple[int, int]:
    """Bytes one batch row takes: per token of KV cache, and for its fixed-size recurrent states."""
    per_token = 0
    for pair in io.kv_pairs:
        if pair.layout == "static":
            continue
        shape = pair.buffer_shape(1, 1)
        per_token += len(pair.inputs) * int(np.prod(shape)) * np.dtype(dtype_of(pair.dtype)).itemsize
    states = 0
    for state in io.state_pairs:
        dims = [int(d) for d in state.shape if isinstance(d, int)]  # every axis but the batch one is static
        states += int(np.prod(dims)) * np.dtype(dtype_of(state.dtype)).itemsize
    return per_token, states


def default_max_model_len(io: DecoderIO, context: int | None, max_batch: int) -> tuple[int, str]:
    """Tokens per sequence when the user gives none, and why: the model's context (``DEFAULT_MAX_MODEL_LEN``
    when it states none), cut to what the KV budget holds for ``max_batch`` rows but never below
    ``min(context, DEFAULT_MAX_MODEL_LEN)``."""
    if context is None:
        return DEFAULT_MAX_MODEL_LEN, "the model states no context length"
    floor = min(context, DEFAULT_MAX_MODEL_LEN)
    per_token, states = row_bytes(io)
    budget = kv_budget_bytes()
    if budget is None or per_token == 0:
        return context, "the model's context"
    fits = (budget // max_batch - states) // per_token
    if fits >= context:
        return context, "the model's context"
    length = max(floor, int(fits))
    need = max_batch * (states + context * per_token)
    return length, (
        f"cut from the model's context of {context}: {max_batch} rows of {context} tokens would take "
        f"{need / 2**30:.1f} GiB of KV cache, more than {KV_BUDGET_SHARE:.0%} of the memory available "
        f"({budget / KV_BUDGET_SHARE / 2**30:.1f} GiB); --max-model-len or a smaller --max-batch changes it"
    )
