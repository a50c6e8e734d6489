"""EngineConfig: every setting of an engine in one frozen, validated value, and the environment's share.

:func:`onnxgen.load`, the CLI and the server build one :class:`EngineConfig` and pass it down whole, so no
layer repeats the list of settings. :meth:`EngineConfig.from_env` is the only reader of onnxgen's
``ONNXGEN_*`` variables:

- ``ONNXGEN_THREADS``: intra-op threads (an integer >= 1);
- ``ONNXGEN_FUSE``, ``ONNXGEN_FAST_OPS``, ``ONNXGEN_HUGE_PAGES``, ``ONNXGEN_SPINNING``: on/off switches, each taking
  ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case, surrounding spaces ignored);
  unset or empty leaves the decision to onnxgen's default. Any other value is refused with a
  :class:`~onnxgen.errors.SettingError` naming the variable, so a typo never silently keeps the default;
- ``ONNXGEN_MODEL``, ``ONNXGEN_CACHE_DIR``, ``ONNXGEN_API_KEY``: what to run, where the prepared graphs are
  kept, the server's key (read by :func:`env_model`, :func:`env_cache_dir`, :func:`env_api_key`);
- ``ONNXGEN_CACHE``: an on/off switch; off keeps no prepared graph on disk past the process
  (:func:`env_cache_off`);
- ``ONNXGEN_STEP_TRACE``: a file the server appends one JSON line per scheduler iteration to (its
  forwards, host work and waits: :mod:`onnxgen.server.trace`); unset, nothing is traced
  (:func:`env_step_trace`).

A keyword given to :func:`onnxgen.load` (or a CLI flag) overrides the environment.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxgen.errors import SettingError
from onnxgen.runtime.plan_names import DECODE_PLANS

THREADS = "ONNXGEN_THREADS"
FUSE = "ONNXGEN_FUSE"  # onnxgen.graph.decode_fusions
FAST_OPS = "ONNXGEN_FAST_OPS"  # onnxgen.graph.hybrid_ops
HUGE_PAGES = "ONNXGEN_HUGE_PAGES"  # onnxgen.runtime.hugepages
SPINNING = "ONNXGEN_SPINNING"  # onnxgen.runtime.session.make_session_options
MODEL = "ONNXGEN_MODEL"
CACHE_DIR = "ONNXGEN_CACHE_DIR"
CACHE = "ONNXGEN_CACHE"  # onnxgen.runtime.graph_cache: off keeps nothing on disk past the process
API_KEY = "ONNXGEN_API_KEY"
STEP_TRACE = "ONNXGEN_STEP_TRACE"  # onnxgen.server.trace
SWITCHES = {
    FUSE: "fuse",
    FAST_OPS: "fast_ops",
    HUGE_PAGES: "huge_pages",
    SPINNING: "spinning",
}  # var -> field
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")
DEFAULT_MAX_MODEL_LEN = 2048  # tokens per sequence where neither the config nor the model says fewer


@dataclass(frozen=True)
class EngineConfig:
    """How an engine runs a model (what it generates is :class:`~onnxgen.generation.params.SamplingParams`).

    Attributes:
        threads: onnxruntime intra-op threads; None: one per core.
        providers: onnxruntime execution providers in order of preference; None: the CPU.
        decode_plan: how single-token steps of a Scan-based hybrid run: ``"auto"`` (whichever the model
            gains from), ``"scan"`` (as exported) or ``"inline"`` (its Scans inlined in a sibling session);
            see :mod:`onnxgen.runtime.decode_routing`.
        huge_pages: back the weights with transparent huge pages on Linux (faster decode steps, slower
            loads; :mod:`onnxgen.runtime.hugepages`); None: on.
        speculative: the model will verify drafts, so a hybrid's session is made on the verify plan's graph
            at once instead of at the first speculative verify, and an MTP head beside the model is loaded
            with it rather than in the first MTP request; plain decoding works either way.
        fast_ops: run a hybrid's ``GatedRMSNorm`` and SiLU-fused ``CausalConvWithState`` on onnxruntime's
            vectorized CPU kernels (the same math rounded differently; :mod:`onnxgen.graph.hybrid_ops`);
            None: on unless the export quantizes activations to int8; False runs the export's ops as they are.
        fuse: merge projections that read one input into one int4 MatMulNBits, and a fused QKV's query/key
            RMSNorms into one, on the CPU (the same output bits; :mod:`onnxgen.graph.decode_fusions`);
            None: on.
        spinning: onnxruntime's intra-op threads spin while they wait for work (its default) rather than
            sleep; None: on. Off frees the cores between a forward's parallel sections, which pays where
            other processes share the cores: there an op's threads wait on each other whenever the
            scheduler takes one away, and spinning threads make that likelier (docs/benchmarks.md,
            "Continuous batching at real size").
        max_batch: sequences decoded together in a batch.
        max_queue: prompts that may wait for a batch row before new requests are refused (server).
        max_model_len: tokens per batched sequence (prompt + generated); None: the model's context, cut to
            what a quarter of the available memory holds for ``max_batch`` rows of KV cache and states
            (never below ``DEFAULT_MAX_MODEL_LEN`` or the context, whichever is less;
            :func:`onnxgen.engine.limits.default_max_model_len`).
        prefill_chunk: prompt tokens per batched prefill forward (also the budget between two decode steps);
            at least 2.
        min_rows: rows every batched decode step runs, idle ones padding it, so that kernels computing one
            row differently from several give a sequence the same tokens alone or beside others; None:
            probed on this CPU (:func:`onnxgen.runtime.batch.invariant_min_rows`).
        batch_prefill: prefill the equal-length prompts that one scheduler iteration takes as one
            multi-row forward (each prompt's logits and states the same bits as prefilled alone; off by
            default: it has not been faster on CPU and holds up to ``max_batch`` rows of prefill state).
        prefix_cache_mb: MiB of prompts' and replies' KV rows and recurrent-state checkpoints kept, so a
            request that shares a prefix with an earlier one (a system prompt, a chat's history) prefills
            only the rest (:mod:`onnxgen.cache.prefix`); 0 (the library's default): off; None: a tenth of
            the memory available at load, at most ``AUTO_PREFIX_CACHE_MAX_MB``
            (:func:`onnxgen.cache.prefix.auto_prefix_cache_mb`; ``onnxgen chat``'s default).
        checkpoint_interval: tokens of a long prefill between two cached checkpoints of a hybrid's
            recurrent states; None: 256.
        exact_speculation: speculate only where a verify forward computes the bits single decode steps
            would (probed once per model: :mod:`onnxgen.runtime.verify_check`), so speculative greedy
            output is plain greedy output; elsewhere speculative requests decode plainly. None: so for
            exports whose ``MatMulNBits`` quantize activations to int8 (where a last-bit difference grows
            into a different token), while other exports speculate (their verify rows may differ from
            single steps in the last bits, which changes a greedy token only at a near-tie); False:
            always speculate (docs/speculative-commit.md, "Exactness").
    """

    threads: int | None = None
    providers: tuple[str, ...] | None = None
    decode_plan: str = "auto"
    huge_pages: bool | None = None
    speculative: bool = False
    fast_ops: bool | None = None
    fuse: bool | None = None
    spinning: bool | None = None
    max_batch: int = 16
    max_queue: int = 64
    max_model_len: int | None = None
    prefill_chunk: int = 512
    min_rows: int | None = None
    batch_prefill: bool = False
    prefix_cache_mb: float | None = 0
    checkpoint_interval: int | None = None
    exact_speculation: bool | None = None

    def __post_init__(self) -> None:
        if self.providers is not None:
            providers = self.providers
            if isinstance(providers, str) or not all(isinstance(p, str) and p for p in providers):
                _refuse("providers", providers, "a sequence of execution provider names or None")
            object.__setattr__(self, "providers", tuple(providers))
        if self.decode_plan not in DECODE_PLANS:
            _refuse("decode_plan", self.decode_plan, f"one of {', '.join(DECODE_PLANS)}")
        for name in ("huge_pages", "fast_ops", "fuse", "spinning", "exact_speculation"):
            if getattr(self, name) not in (None, True, False):
                _refuse(name, getattr(self, name), "True, False or None (onnxgen's default)")
        for name in ("speculative", "batch_prefill"):
            if not isinstance(getattr(self, name), bool):
                _refuse(name, getattr(self, name), "True or False")
        mb = self.prefix_cache_mb
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int | float) or not mb >= 0):
            _refuse("prefix_cache_mb", mb, ">= 0 (a size in MiB; 0 turns prefix caching off) or None (auto)")
        for name, least, optional in (
            ("threads", 1, True),
            ("max_batch", 1, False),
            ("max_queue", 1, False),
            ("max_model_len", 2, True),
            ("prefill_chunk", 2, False),
            ("min_rows", 1, True),
            ("checkpoint_interval", 1, True),
        ):
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                _refuse(name, value, f"an integer >= {least}" + (" or None" if optional else ""))

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_env(cls, **overrides: Any) -> EngineConfig:
        """The settings the environment gives, with ``overrides`` on top (a None override keeps the
        environment's value: it stands for "not given", as an unset flag does)."""
        given: dict[str, Any] = {SWITCHES[name]: env_switch(name) for name in SWITCHES}
        given["threads"] = env_threads()
        return cls(**{k: v for k, v in given.items() if v is not None}).replace(**overrides)

    def replace(self, **overrides: Any) -> EngineConfig:
        """A copy with the non-None ``overrides`` set; an unknown name is refused, naming the known ones."""
        unknown = sorted(set(overrides) - set(self.fields()))
        if unknown:
            raise SettingError(
                f"unknown engine setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                f"the settings are {', '.join(self.fields())}"
            )
        if isinstance(overrides.get("providers"), list):
            overrides["providers"] = tuple(overrides["providers"])
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})


def _refuse(name: str, value: object, wanted: str) -> None:
    raise SettingError(f"{name} must be {wanted} (got {value!r})")


def env_switch(name: str) -> bool | None:
    """``name``'s value as a switch: True, False, or None where it is unset or empty."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value in ON:
        return True
    if value in OFF:
        return False
    raise SettingError(
        f"{name}={raw!r} is not an on/off value; set it to one of {', '.join(ON)} (on) or "
        f"{', '.join(OFF)} (off), or unset it for onnxgen's default"
    )


def default_threads() -> int:
    """All cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def env_threads() -> int | None:
    """``$ONNXGEN_THREADS`` as a count, None where unset or empty."""
    raw = os.environ.get(THREADS, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise SettingError(f"${THREADS} must be an integer >= 1 (got {raw!r}); unset it or give a count")
    return value


def _env_text(name: str) -> str | None:
    return os.environ.get(name, "").strip() or None


def env_model() -> str | None:
    """``$ONNXGEN_MODEL``: the model a command runs when none is given."""
    return _env_text(MODEL)


def env_cache_dir() -> str | None:
    """``$ONNXGEN_CACHE_DIR``: where prepared session graphs are kept."""
    return _env_text(CACHE_DIR)


def cache_home() -> Path:
    """The folder onnxgen keeps what it makes on disk in (prepared graphs, converted GGUF files, pulled
    models): ``$ONNXGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/onnxgen``, else ``~/.cache/onnxgen``."""
    given = env_cache_dir()
    if given:
        return Path(given).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "onnxgen"


def env_cache_off() -> bool:
    """Whether ``$ONNXGEN_CACHE`` turns the on-disk cache of prepared graphs off."""
    return env_switch(CACHE) is False


def env_api_key() -> str | None:
    """``$ONNXGEN_API_KEY``: the key the server asks of clients when ``--api-key`` is not given."""
    return os.environ.get(API_KEY) or None


def env_step_trace() -> str | None:
    """``$ONNXGEN_STEP_TRACE``: where the server writes its per-iteration timing trace (None: no trace)."""
    return _env_text(STEP_TRACE)
