"""BatchLimits: an :class:`~onnxgen.config.EngineConfig`'s batch settings resolved against a loaded model."""

from __future__ import annotations

from dataclasses import dataclass

from onnxgen.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from onnxgen.errors import SettingError
from onnxgen.model import ModelPackage
from onnxgen.runtime.batch import invariant_min_rows
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
        """``config``'s limits, where it leaves them open: the model's context (at most
        ``DEFAULT_MAX_MODEL_LEN``) and the ``min_rows`` this CPU's kernels need (probed on ``session``)."""
        context = package.context_length
        max_len = config.max_model_len or min(context or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)
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
