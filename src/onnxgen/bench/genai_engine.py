"""The onnxruntime-genai side of ``onnxgen bench``: the same greedy run, timed the same way.

Threads are set through a config overlay (``model.decoder.session_options.intra_op_num_threads``);
without it onnxruntime-genai picks its own count (1 on a 2-core machine), which would not be a
like-for-like comparison. The worker reports its OS thread count after load so the effect is visible.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onnxgen.errors import OnnxgenError

GENAI = "onnxruntime-genai"
INSTALL_HINT = "install it with `pip install onnxruntime-genai` (or `pip install 'onnxgen[external]'`)"


class BenchError(OnnxgenError):
    """A benchmark cannot run as asked (missing engine, worker failure, sizes past the context)."""


def require_genai() -> None:
    """Raise a clear error when onnxruntime-genai is not importable."""
    if importlib.util.find_spec("onnxruntime_genai") is None:
        raise BenchError(
            f"--compare {GENAI} needs the onnxruntime_genai package, which is not installed; {INSTALL_HINT}"
        )


def step_durations_ms(stamps: Sequence[float]) -> list[float]:
    """Milliseconds between successive perf_counter stamps (one per token after the first)."""
    return [1000.0 * (b - a) for a, b in itertools.pairwise(stamps)]


def threads_overlay(threads: int) -> str:
    """The genai_config overlay that sets the decoder session's intra-op thread count."""
    return json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}})


class GenaiEngine:
    """One onnxruntime-genai model on the CPU provider with a fixed intra-op thread count."""

    name = GENAI

    def __init__(self, model_dir: str | Path, threads: int) -> None:
        try:
            import onnxruntime_genai as og
        except ImportError as e:
            raise BenchError(f"onnxruntime_genai cannot be imported ({e}); {INSTALL_HINT}") from e
        if not (Path(model_dir) / "genai_config.json").is_file():
            raise BenchError(
                f"{model_dir} has no genai_config.json, which onnxruntime-genai needs; "
                "benchmark an export made by the onnxruntime-genai model builder (or mobius --runtime ort-genai)"
            )
        self._og = og
        config = og.Config(str(model_dir))
        config.clear_providers()
        config.overlay(threads_overlay(threads))
        self.model = og.Model(config)
        self.version = getattr(og, "__version__", "unknown")

    def info(self) -> dict[str, Any]:
        return {"version": self.version}

    def run(self, prompt: Sequence[int], new_tokens: int) -> dict[str, Any]:
        """Greedy, exactly ``new_tokens`` tokens: prefill = append_tokens, then one step per token.

        ``generate_next_token`` right after ``append_tokens`` only picks from the prefill's logits; every
        later call runs one decode forward first, so steps 2..N are the decode steps.
        """
        import numpy as np

        og = self._og
        total = len(prompt) + new_tokens
        start = time.perf_counter()
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=total, min_length=total)
        generator = og.Generator(self.model, params)
        ids32 = np.asarray(prompt, dtype=np.int32)
        t0 = time.perf_counter()
        generator.append_tokens(ids32)
        t1 = time.perf_counter()
        generator.generate_next_token()
        stamps = [time.perf_counter()]
        while not generator.is_done():
            generator.generate_next_token()
            stamps.append(time.perf_counter())
        ids = [int(t) for t in generator.get_sequence(0)[len(prompt) :]]
        return {
            "prefill_ms": 1000.0 * (t1 - t0),
            "ttft_ms": 1000.0 * (stamps[0] - start),
            "step_ms": step_durations_ms(stamps),
            "total_ms": 1000.0 * (stamps[-1] - start),
            "token_ids": ids,
        }
