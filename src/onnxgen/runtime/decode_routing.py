"""Decode plans: single-token steps of a Scan-based hybrid on a copy of the graph with its Scans inlined.

- ``"scan"``: every forward runs the export as it is (its Scans iterate over the sequence axis).
- ``"inline"``: single-token steps run in a sibling onnxruntime session whose graph has every eligible Scan
  spliced in as one iteration (:mod:`onnxgen.graph.scan_inline`), built at the first single-token step.
  Prefill and multi-token steps (speculative verify) stay on the main session, so the collapsed graph never
  sees more than one token. Both sessions bind the same KV and state buffers by port name.
- ``"auto"``: ``"inline"`` where the Scans' fixed cost is a real share of a decode step, else ``"scan"``
  (:func:`choose_decode_plan`).
- ``"main"``: what a graph without an eligible Scan runs, whatever was asked.

Weights are held once. Each onnxruntime session prepacks MatMul weights into its own heap copy, so two plain
sessions hold them twice. The inline plan instead runs both sessions from one optimized copy of the model
(:func:`optimized_copy`) whose prepacked weights onnxruntime saved to a data file: both sessions map that file,
so the pages are shared and nothing is repacked. The sibling is checked bit for bit against the main session
on a first step before it is used; where they differ the Scan plan runs instead. :func:`settle_decode_plan`
is the one rule that turns the choice and that check into the plan that runs: the runtime routes by it and
``onnxgen inspect`` reports it.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import shutil
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnxruntime as ort

from onnxgen.errors import UnsupportedModelError
from onnxgen.runtime.binding import Binder
from onnxgen.runtime.graph_cache import cache_root, relocate
from onnxgen.runtime.plan_names import DECODE_PLANS as DECODE_PLANS
from onnxgen.runtime.session import FOLDER_KEY

if TYPE_CHECKING:
    from onnxgen.model.package import ModelPackage
    from onnxgen.runtime.session import DecoderSession

log = logging.getLogger(__name__)

INLINE_FILE = "inline.onnx"
# How the optimized copy is saved: weights (and onnxruntime's prepacked forms of them) in one data file.
_SAVE_PREPACKED = {
    "session.optimized_model_external_initializers_file_name": "weights.bin",
    "session.optimized_model_external_initializers_min_size_in_bytes": "1024",
    "session.save_external_prepacked_constant_initializers": "1",
}

# The auto rule; docs/decode-plan.md has the measurements behind the figures. A Scan costs about
# SCAN_STEP_COST_S per decode step on top of its body's math; an fp32 decode step reads its weights at about
# DECODE_BYTES_PER_S. The inline plan is picked when the Scans are at least AUTO_MIN_SHARE of a step.
SCAN_STEP_COST_S = 10e-6
DECODE_BYTES_PER_S = 10e9
AUTO_MIN_SHARE = 0.03
TRIAL_STEPS = 8  # decode steps each plan runs before auto keeps the faster one


@dataclass(frozen=True)
class ScanSummary:
    """The Scans of a graph: those the inline pass splices, those it leaves (with why), the weight bytes."""

    inlinable: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)
    weight_bytes: int = 0

    @property
    def scan_share(self) -> float:
        """Estimated share of a decode step taken by the inlinable Scans' fixed cost."""
        scans = len(self.inlinable) * SCAN_STEP_COST_S
        return scans / (scans + self.weight_bytes / DECODE_BYTES_PER_S) if scans else 0.0


@dataclass(frozen=True)
class PlanChoice:
    """The plan single-token steps run on, what was asked for, and why."""

    requested: str
    plan: str  # "main" | "scan" | "inline"
    reason: str


@dataclass(frozen=True)
class InlineCheck:
    """The inline sibling's first step against the main session's: equal bit for bit, or why it is not used
    (its outputs differ, or it could not be made)."""

    equal: bool
    detail: str


def settle_decode_plan(choice: PlanChoice, check: InlineCheck | None) -> PlanChoice:
    """The plan single-token steps run on: ``choice``, or the Scan plan where ``choice`` is the inline plan
    and its first-step check failed (``check`` None: not run yet, the choice stands)."""
    if choice.plan != "inline" or check is None:
        return choice
    if check.equal:
        return PlanChoice(choice.requested, "inline", f"{choice.reason}; checked: {check.detail}")
    return PlanChoice(
        choice.requested,
        "scan",
        f"the inline plan was chosen ({choice.reason}) but is not used: {check.detail}; decoding on the "
        "Scan plan",
    )


def summarize_scans(graph: onnx.ModelProto) -> ScanSummary:
    """Which Scans of ``graph`` (weights not needed) the inline pass would splice, and the weight bytes."""
    if not any(n.op_type == "Scan" for n in graph.graph.node):
        return ScanSummary(weight_bytes=_weight_bytes(graph))
    # onnx-ir (and the sympy it imports, slow to import and large) only for graphs that have a Scan
    import onnx_ir as ir

    from onnxgen.graph.scan_inline import find_inlinable_scans

    with_shapes = _with_inferred_shapes(graph)
    inlinable, skipped = find_inlinable_scans(ir.serde.deserialize_model(with_shapes))
    return ScanSummary(tuple(inlinable), skipped, _weight_bytes(graph))


def _with_inferred_shapes(graph: onnx.ModelProto) -> onnx.ModelProto:
    """``graph`` with inferred value shapes (so a static scan extent > 1 is seen); as given if inference fails."""
    try:
        return onnx.shape_inference.infer_shapes(graph, strict_mode=False)
    except Exception as e:  # inference is an aid only: the pass falls back on declared shapes
        log.debug("shape inference failed (%s); using declared shapes", e)
        return graph


def _weight_bytes(model: onnx.ModelProto) -> int:
    total = 0
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            total += next((int(e.value) for e in t.external_data if e.key == "length"), 0)
        else:
            total += len(t.raw_data) or int(np.prod(t.dims)) * 4
    return total


_WARNED: set[tuple[str, str]] = set()
_WARNED_LOCK = threading.Lock()


def warn_once(model: str | Path, kind: str, message: str, *args: object) -> None:
    """Log ``message`` as a warning the first time this process says ``kind`` about ``model``: a decode
    plan that is not available is worth one line per model, not one per load or per request (servers and
    benchmarks load a model again and again)."""
    key = (str(model), kind)
    with _WARNED_LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    log.warning(message, *args)


def choose_decode_plan(requested: str, summary: ScanSummary) -> PlanChoice:
    """The plan for ``requested`` (``auto``, ``scan`` or ``inline``) on a graph summarised by ``summary``."""
    if requested not in DECODE_PLANS:
        raise ValueError(f"decode_plan={requested!r} is not a plan; choose one of {', '.join(DECODE_PLANS)}")
    if not summary.inlinable:
        why = "; ".join(f"{k}: {v}" for k, v in summary.skipped.items()) or "the graph has no Scan"
        return PlanChoice(requested, "main", f"no eligible Scan ({why})")
    if requested != "auto":
        return PlanChoice(requested, requested, f"decode_plan={requested!r} was requested")
    share = summary.scan_share
    detail = (
        f"{len(summary.inlinable)} Scans at ~{SCAN_STEP_COST_S * 1e6:.0f} us/step against "
        f"{summary.weight_bytes / 1e6:.1f} MB of weights: the Scans are ~{share:.1%} of a decode step"
    )
    if share >= AUTO_MIN_SHARE:
        return PlanChoice(requested, "inline", f"{detail} (>= {AUTO_MIN_SHARE:.0%})")
    return PlanChoice(requested, "scan", f"{detail} (< {AUTO_MIN_SHARE:.0%}: not worth a second session)")


# -- the shared optimized copy ---------------------------------------------------------------------------


def _cache_key(model_path: Path, graph: onnx.ModelProto) -> str:
    """Changes with the model file, its data files, onnxruntime and the CPU (prepacked layouts depend on it)."""
    h = hashlib.sha256(model_path.read_bytes())
    files = {e.value for t in graph.graph.initializer for e in t.external_data if e.key == "location"}
    for name in sorted(files):
        path = model_path.parent / name
        st = path.stat()  # small files by content (rebuilt fixtures share one entry), large by size and time
        h.update(name.encode() + (path.read_bytes() if st.st_size <= 2**26 else f"{st.st_mtime_ns}".encode()))
        h.update(f":{st.st_size}".encode())
    h.update(f"{ort.__version__}|{platform.machine()}|{_cpu_identity()}".encode())
    return h.hexdigest()[:24]


def _cpu_identity() -> str:
    """The CPU model and feature flags (not its clock, which /proc/cpuinfo reports as it changes)."""
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        return platform.processor()
    keep = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags", "Features", "CPU part")
    first = info.read_text().split("\n\n")[0].splitlines()
    return "|".join(line for line in first if line.split(":")[0].strip() in keep)


def optimized_copy(model_path: Path, graph: onnx.ModelProto, cache_dir: str | Path | None = None) -> Path:
    """An onnxruntime-optimized copy of the model whose prepacked weights live in its data file, beside the
    same graph with its Scans inlined (``inline.onnx``, same data file); made once, kept under
    :func:`cache_root`. Returns the directory holding both."""
    root = cache_root(cache_dir) / "plans"
    final = root / _cache_key(model_path, graph)
    if (final / INLINE_FILE).is_file():
        return final
    from onnxgen.graph.scan_inline import inline_scans_in_proto  # imports onnx-ir: see summarize_scans

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.optimized_model_filepath = str(tmp / "model.onnx")
        for key, value in _SAVE_PREPACKED.items():
            opts.add_session_config_entry(key, value)
        ort.InferenceSession(str(model_path), sess_options=opts, providers=["CPUExecutionProvider"])
        result = inline_scans_in_proto(onnx.load(str(tmp / "model.onnx"), load_external_data=False))
        if not result.report.inlined:
            raise UnsupportedModelError(
                f"onnxruntime's optimized graph of {model_path} has no inlinable Scan"
            )
        onnx.save(result.model, str(tmp / INLINE_FILE))
        try:
            tmp.rename(final)
        except OSError:  # another process made it first
            if not (final / INLINE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# -- routing ----------------------------------------------------------------------------------------------


class DecodePlan:
    """Routes each forward to the main session or, for single-token steps, to the inline sibling."""

    def __init__(self, choice: PlanChoice, inline_path: Path | None = None) -> None:
        self.choice = choice
        self._inline_path = inline_path  # the sibling's graph, when the plan is "inline"
        self._lock = threading.Lock()  # one build when forwards of several states start at once
        self._main: DecoderSession | None = None
        self.sibling: ort.InferenceSession | None = None
        self.check: InlineCheck | None = None  # the sibling's first-step check, once it ran
        # auto's pick is measured before it is kept: the first steps alternate between the two plans (the
        # same bits, checked) by parity, and the faster one runs from then on (:meth:`observe`)
        self._trial: dict[int, list[float]] | None = (
            {0: [], 1: []} if choice.requested == "auto" and choice.plan == "inline" else None
        )

    @property
    def name(self) -> str:
        """The plan single-token steps run on: ``"inline"``, ``"scan"`` or ``"main"`` (for the inline plan,
        what its check decided; the choice itself before the first single-token step)."""
        return settle_decode_plan(self.choice, self.check).plan

    def settle(self) -> PlanChoice:
        """The plan single-token steps run on and why, running the inline plan's check now where it has
        not run yet (the first single-token step would run it)."""
        if self.choice.plan == "inline" and self._inline_path is not None and self._main is not None:
            self._ensure_sibling()
        return settle_decode_plan(self.choice, self.check)

    def attach(self, session: DecoderSession) -> None:
        """Route ``session``'s forwards through this plan."""
        self._main = session
        session.plan = self

    def session_for(self, tokens: int, parity: int = 0) -> ort.InferenceSession:
        """The onnxruntime session that runs a forward over ``tokens`` new tokens (``parity``: the step's
        parity, which picks the plan while auto's pick is on trial)."""
        main = self._main
        if main is None:
            raise RuntimeError("DecodePlan.attach() the plan to its DecoderSession first")
        if tokens != 1 or self._inline_path is None or (self.check is not None and not self.check.equal):
            return main.current()
        if self.sibling is None:
            self._ensure_sibling()
        if self.sibling is None or (self._trial is not None and parity == 1):
            return main.current()
        return self.sibling

    def observe(self, parity: int, seconds: float) -> None:
        """A decode step of ``parity`` took ``seconds``: while auto's pick is on trial, keep the faster plan
        once each has run ``TRIAL_STEPS`` steps (the inline plan only where it is faster)."""
        trial = self._trial
        if trial is None or self.sibling is None:
            return
        trial[parity].append(seconds)
        if min(len(trial[0]), len(trial[1])) < TRIAL_STEPS:
            return
        inline, scan = (float(np.median(trial[p])) for p in (0, 1))
        self._trial = None
        measured = f"its steps took {inline * 1e3:.2f} ms against the Scan plan's {scan * 1e3:.2f} ms here"
        if inline >= scan:
            self.check = InlineCheck(False, f"{measured} (auto keeps the faster plan)")
            log.info("decode plan: the Scan plan, %s", measured)
        else:
            self.check = InlineCheck(True, f"{self.check.detail if self.check else ''}; {measured}")

    def _ensure_sibling(self) -> None:
        """Build the inline sibling and check it against the main session, once."""
        assert self._main is not None and self._inline_path is not None
        with self._lock:
            if self.check is not None:
                return
            try:
                self.sibling = build_sibling(self._main, self._inline_path)
            except Exception as e:
                self.check = InlineCheck(False, str(e))
                message = "the inline decode plan is unavailable, decoding on the Scan plan: %s"
                if self.choice.requested == "inline":  # asked for: said once per model
                    warn_once(self._inline_path, "inline", message, e)
                else:  # auto's pick: the Scan plan it falls back on is what was asked for
                    log.info(message, e)
            else:
                self.check = InlineCheck(True, "its first step equals the Scan plan's bit for bit")


def build_sibling(main: DecoderSession, inline_path: Path) -> ort.InferenceSession:
    """A session over the inlined graph at ``inline_path`` with ``main``'s options, providers and graph
    rewrites (:meth:`SessionGraph.same_rewrites`: logits-to-keep, fast ops, decode fusions); raises when
    it cannot be made or does not match ``main`` bit for bit on a step."""
    inlined = main.prepared.same_rewrites(
        onnx.load(str(inline_path), load_external_data=False), inline_path.parent
    )
    opts = main.session.get_session_options()
    if _has_config(opts, FOLDER_KEY):  # the main session's weights folder: locations relative to it
        relocate(inlined, inline_path.parent.resolve(), Path(opts.get_session_config_entry(FOLDER_KEY)))
    else:
        opts.add_session_config_entry(FOLDER_KEY, str(inline_path.parent))
    providers = main.session.get_providers()
    sibling = ort.InferenceSession(inlined.SerializeToString(), sess_options=opts, providers=providers)
    token = _probe_token(main)
    ref, got = _probe(main, main.session, token), _probe(main, sibling, token)
    if not np.isfinite(ref[main.io.logits]).all():
        raise UnsupportedModelError(
            f"the first-step check could not run: the Scan graph's logits for token {token} are not finite"
        )
    for name, value in ref.items():
        # NaN where both have NaN counts as equal (a state slot a graph never writes may hold NaN)
        if value.shape != got[name].shape or not np.array_equal(
            value, got[name], equal_nan=value.dtype.kind == "f"
        ):
            gap = (
                f" by up to {float(np.max(np.abs(value.astype(np.float64) - got[name]))):.3g}"
                if value.shape == got[name].shape and value.dtype.kind == "f"
                else ""
            )
            raise UnsupportedModelError(
                f"the inlined graph's {name!r} differs from the Scan graph's on a first step{gap}; "
                "run this model with decode_plan='scan' (--decode-plan scan)"
            )
    return sibling


def _has_config(opts: ort.SessionOptions, key: str) -> bool:
    try:
        opts.get_session_config_entry(key)
    except RuntimeError:
        return False
    return True


def _probe_token(main: DecoderSession) -> int:
    """The token the check feeds: one from the middle of the vocabulary. Token 0 is often padding, whose
    embedding row some checkpoints leave at zero, and a zero vector through an L2 norm without epsilon gives
    NaN everywhere, which would make the check compare nothing."""
    return max(main.vocab_size // 2, 1) if main.vocab_size > 0 else 1


def _probe(main: DecoderSession, session: ort.InferenceSession, token: int) -> dict[str, np.ndarray]:
    """Every output of ``session`` for ``token`` on an empty decode state."""
    state = main.new_state(1)
    binding = session.io_binding()
    main._bind_step_inputs(Binder(binding), 0, np.full((1, 1), token, dtype=np.int64), 1)
    step = state.prepare(1)
    names = [n for n, _ in step.outputs] + [main.io.logits]
    for n, v in step.inputs:
        binding.bind_ortvalue_input(n, v)
    for n in names:
        binding.bind_output(n, "cpu")
    session.run_with_iobinding(binding)
    return {n: v.numpy() for n, v in zip(names, binding.get_outputs(), strict=True)}


@dataclass
class PreparedPlan:
    """What :func:`prepare_decode_plan` decided and the model the main session loads."""

    plan: DecodePlan
    summary: ScanSummary
    model_path: Path  # what the main session loads: the package's model, or its optimized copy
    graph: onnx.ModelProto | None  # that model's graph, weights not loaded (None once the session has it)

    @property
    def choice(self) -> PlanChoice:
        return self.plan.choice


def prepare_decode_plan(
    package: ModelPackage,
    requested: str = "auto",
    *,
    providers: Sequence[str] | None = None,
    cache_dir: str | Path | None = None,
) -> PreparedPlan:
    """Choose the plan for ``package``; for the inline plan, make the optimized copy both sessions load
    (one warning and the Scan plan when it cannot be made)."""
    summary = summarize_scans(package.graph)
    choice = choose_decode_plan(requested, summary)
    if requested == "inline" and choice.plan == "main":
        warn_once(
            package.model_path,
            "no-scan",
            "decode_plan='inline' (--decode-plan inline) was asked for, but %s has %s; every step runs on "
            "the export's own graph",
            package.model_path,
            choice.reason,
        )
    if choice.plan == "inline" and any(p != "CPUExecutionProvider" for p in providers or ()):
        choice = PlanChoice(
            requested, "scan", "the inline plan shares prepacked CPU weights; CPU provider only"
        )
        if requested == "inline":
            warn_once(
                package.model_path,
                "providers",
                "decode_plan='inline' (--decode-plan inline) is not available with providers %s; decoding "
                "on the Scan plan",
                providers,
            )
    if choice.plan != "inline":
        return PreparedPlan(DecodePlan(choice), summary, package.model_path, package.graph)
    try:
        folder = optimized_copy(package.model_path, package.graph, cache_dir)
        path = folder / "model.onnx"
        graph = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        warn_once(
            package.model_path,
            "inline",
            "the inline decode plan is unavailable, decoding on the Scan plan: %s",
            e,
        )
        scan = PlanChoice(requested, "scan", f"inline plan unavailable: {e}")
        return PreparedPlan(DecodePlan(scan), summary, package.model_path, package.graph)
    return PreparedPlan(DecodePlan(choice, folder / INLINE_FILE), summary, path, graph)
