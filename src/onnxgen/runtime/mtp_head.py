"""MTPHeadSession: runs an MTP head (``mtp.onnx``) over its own KV cache, fed the target's hidden states.

The head is a one-layer decoder, so it runs on a :class:`~onnxgen.runtime.session.DecoderSession` like any
decoder (IO binding, a :class:`~onnxgen.runtime.state.DecodeState` for its KV cache, logits of the last
row only); the hidden-state input is bound per forward (``feeds``) and the head's output hidden state is
fetched beside the logits (``fetch``). ``int4_lm_head`` runs a float lm_head as int4
(:mod:`onnxgen.graph.int4_lm_head`): the engine drafts with it, since verification makes the drafts' rounding
invisible in the output; the head's exact logits (export checks, tests against a reference) are its default.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from onnxgen.model.mtp import MTPHeadIO
from onnxgen.runtime.graph_cache import session_graph
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState


class MTPHeadSession:
    """One loaded head; :meth:`forward` is a forward over entries (token after position i, hidden at i)."""

    def __init__(
        self,
        head: MTPHeadIO,
        *,
        threads: int | None = None,
        providers: Sequence[str] | None = None,
        fuse: bool | None = None,
        int4_lm_head: bool = False,
    ) -> None:
        self.head = head
        self.session = DecoderSession(
            session_graph(
                head.path,
                head.io,
                providers=providers,
                fuse=fuse,
                int4_lm_head=int4_lm_head,
                threads=threads,
            ),
            threads=threads,
            providers=providers,
        )
        self.hidden_size = head.hidden_size
        self.vocab_size = self.session.vocab_size
        self._fetch = (head.hidden_output,)  # one tuple object: forwards bind its buffers once

    def new_state(self, capacity: int) -> DecodeState:
        return self.session.new_state(capacity)

    def forward(
        self, state: DecodeState, tokens: np.ndarray, hidden: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Run entries ``tokens`` ``[1, T]`` with ``hidden`` ``[1, T, hidden]`` after what ``state`` holds;
        return the last entry's logits ``[vocab]`` and output hidden state ``[hidden]`` (both owned by the
        caller)."""
        fetched: dict[str, ort.OrtValue] = {}
        logits = self.session.forward(
            state,
            tokens,
            1,
            fetch=self._fetch,
            fetched=fetched,
            feeds={self.head.hidden_input: np.ascontiguousarray(hidden, dtype=np.float32)},
        )[0, -1]
        out = fetched[self.head.hidden_output].numpy()[0, -1].copy()
        return logits, out


__all__ = ["MTPHeadSession"]
