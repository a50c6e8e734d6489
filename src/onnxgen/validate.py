"""Is an export right? Teacher-forced logits of the export against a reference, position by position.

For each prompt the reference decodes ``new_tokens`` greedy tokens; then both models are fed the prompt and
that continuation (teacher forcing: the tokens are given, so one early difference cannot make the rest of
the comparison meaningless) and their logits are compared at every position:

- top-1 agreement: the share of positions whose argmax is the same;
- max |Δlogit|: the largest absolute difference of one logit;
- mean KL: KL(reference ‖ export) of the softmaxes, averaged over positions;
- where the greedy continuations part: the first continuation token the export's own argmax would not
  have chosen (greedy decoding of the export leaves the reference's path there).

References (:func:`reference_for`): a transformers checkpoint (``config.json`` + weights; needs torch and
transformers, ``pip install 'onnxgen[validate]'``), another export run with its ops unchanged (no fast
ops, no fusions, every position's logits from the graph as exported), or, for ``self_check``, the export
itself run that way: then the comparison measures onnxgen's own rewrites (fast ops, fusions, the decode
plan, logits-to-keep), which the export under test runs with, as :func:`onnxgen.load` sets them up.

Default thresholds (:func:`default_thresholds`, measurements in docs/export-families.md, "Validating an
export") depend on whether the comparison is *exact* or *quantized*:

- exact (the export holds the reference's weights at its precision, or ``--self``): correct fp32 exports
  of the test checkpoints measure a mean KL of 1e-13 to 1e-10 and agree on every top-1, while one weight
  tensor perturbed by 30% of its spread gives a mean KL of ~4e-3: the limits are mean KL 1e-4 and top-1
  0.99 (a near-tie may flip);
- quantized (the export has int4/int8 weights the reference does not): the trained demo model quantized to
  int4 (block 32, int8 activations) measures top-1 0.92 and mean KL 0.030 against its fp32 export: the
  limits are top-1 0.85 and mean KL 0.05. Random-weight checkpoints have nearly flat logits and say little
  here: their int4 exports measure mean KL 0.06-0.3.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxgen.errors import OnnxgenError

if TYPE_CHECKING:  # onnx loads when a model is opened, not with the command line's parser
    from onnxgen.model import ModelPackage

DEFAULT_NEW_TOKENS = 24
# Built-in prompts: code and prose, as the models people export are asked for both.
PROMPTS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import json\n\nwith open('config.json') as f:\n    config = json.load(f)\n",
    "The quick brown fox jumps over the lazy dog. Once upon a time, there was a little robot who",
    "Paris is the capital of France. The river that runs through the city is called",
)


class ValidationError(OnnxgenError):
    """The reference or the prompts cannot be used (a missing package, mismatched vocabularies, ...)."""


@dataclass(frozen=True)
class Thresholds:
    """Where a comparison fails: top-1 agreement below ``min_top1``, mean KL above ``max_kl``, a logit
    further than ``max_abs`` (None: not checked) or greedy continuations that part within the first
    ``min_greedy`` tokens (0: not checked)."""

    min_top1: float = 0.99
    max_kl: float = 1e-4
    max_abs: float | None = None
    min_greedy: int = 0
    kind: str = "exact"  # what the defaults were chosen for ("exact" or "quantized")


QUANTIZED = Thresholds(min_top1=0.85, max_kl=0.05, kind="quantized")
_QUANTIZED_OPS = {"MatMulNBits", "GatherBlockQuantized", "DequantizeLinear", "MatMulInteger", "QLinearMatMul"}


def is_quantized(package: ModelPackage) -> bool:
    """Whether the export computes with quantized weights (int4 MatMulNBits, int8 QDQ...)."""
    from onnxgen.model.graph_ports import all_nodes

    return any(node.op_type in _QUANTIZED_OPS for node in all_nodes(package.graph))


def default_thresholds(export_quantized: bool, reference_quantized: bool) -> Thresholds:
    """Quantized limits where only the export is quantized, else exact ones (module docstring)."""
    return QUANTIZED if export_quantized and not reference_quantized else Thresholds()


@dataclass
class PromptReport:
    """The comparison over one prompt and its continuation."""

    prompt_tokens: int
    new_tokens: int
    top1: float
    max_abs: float
    mean_kl: float
    first_top1_miss: int | None  # first position (0-based, over prompt + continuation) whose argmax differs
    greedy_parts_at: int | None  # first continuation token the export would not have chosen (0-based)


@dataclass
class Report:
    """Every prompt's comparison, the aggregate and the verdict against ``thresholds``."""

    reference: str
    thresholds: Thresholds
    prompts: list[PromptReport] = field(default_factory=list)
    decode_plan: str = ""  # the plan the export's decode steps ran on
    decode_plan_reason: str = ""

    @property
    def top1(self) -> float:
        total = sum(p.prompt_tokens + p.new_tokens for p in self.prompts)
        return sum(p.top1 * (p.prompt_tokens + p.new_tokens) for p in self.prompts) / max(total, 1)

    @property
    def max_abs(self) -> float:
        return max((p.max_abs for p in self.prompts), default=0.0)

    @property
    def mean_kl(self) -> float:
        total = sum(p.prompt_tokens + p.new_tokens for p in self.prompts)
        return sum(p.mean_kl * (p.prompt_tokens + p.new_tokens) for p in self.prompts) / max(total, 1)

    def failures(self) -> list[str]:
        """One line per threshold passed (empty: the export passes)."""
        t, out = self.thresholds, []
        if self.top1 < t.min_top1:
            out.append(f"top-1 agreement {self.top1:.3f} < {t.min_top1}")
        if self.mean_kl > t.max_kl:
            out.append(f"mean KL {self.mean_kl:.3g} > {t.max_kl}")
        if t.max_abs is not None and self.max_abs > t.max_abs:
            out.append(f"max |Δlogit| {self.max_abs:.3g} > {t.max_abs}")
        for i, p in enumerate(self.prompts):
            if t.min_greedy and p.greedy_parts_at is not None and p.greedy_parts_at < t.min_greedy:
                out.append(
                    f"prompt {i}: greedy continuations part at token {p.greedy_parts_at} < {t.min_greedy}"
                )
        if out:
            where = [
                f"prompt {i}: first top-1 miss at position {p.first_top1_miss} (of {p.prompt_tokens} prompt + "
                f"{p.new_tokens} new), greedy parts at new token {p.greedy_parts_at}"
                for i, p in enumerate(self.prompts)
                if p.first_top1_miss is not None
            ]
            out.extend(where)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "passed": not self.failures(),
            "failures": self.failures(),
            "thresholds": asdict(self.thresholds),
            "top1": self.top1,
            "max_abs": self.max_abs,
            "mean_kl": self.mean_kl,
            "prompts": [asdict(p) for p in self.prompts],
            "decode_plan": self.decode_plan,
            "decode_plan_reason": self.decode_plan_reason,
        }


def compare(reference: np.ndarray, export: np.ndarray, prompt_tokens: int) -> PromptReport:
    """Compare two ``[positions, vocab]`` logit arrays over a prompt and its reference-greedy continuation
    (position ``prompt_tokens - 1 + i`` predicts continuation token ``i``, the reference's argmax there)."""
    if reference.shape != export.shape:
        raise ValidationError(
            f"the reference gives logits of shape {list(reference.shape)} but the export {list(export.shape)}; "
            "compare models of one vocabulary"
        )
    ref, got = reference.astype(np.float64), export.astype(np.float64)
    ref_top, got_top = ref.argmax(axis=-1), got.argmax(axis=-1)
    same = ref_top == got_top
    log_p = ref - _logsumexp(ref)
    log_q = got - _logsumexp(got)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(axis=-1)
    misses = np.flatnonzero(~same)
    new = len(ref) - prompt_tokens
    parts = np.flatnonzero(~same[prompt_tokens - 1 : prompt_tokens - 1 + new])
    return PromptReport(
        prompt_tokens=prompt_tokens,
        new_tokens=new,
        top1=float(same.mean()),
        max_abs=float(np.abs(ref - got).max()),
        mean_kl=float(max(kl.mean(), 0.0)),
        first_top1_miss=int(misses[0]) if misses.size else None,
        greedy_parts_at=int(parts[0]) if parts.size else None,
    )


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=-1, keepdims=True)
    return top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


# -- the models --------------------------------------------------------------------------------------

# (prompt ids, new_tokens) -> (continuation ids, logits [len(prompt) + new_tokens, vocab])
Reference = Callable[[list[int], int], tuple[list[int], np.ndarray]]


def export_logits(llm: Any, prompt: list[int], continuation: Sequence[int]) -> np.ndarray:
    """An onnxgen LLM's logits at every position of ``prompt + continuation``: the prompt prefilled in one
    forward, then one decode step per continuation token (so the decode plan runs them)."""
    session = llm.session
    state = session.new_state(len(prompt) + len(continuation) + 1)
    rows = [session.forward(state, np.asarray([prompt], dtype=np.int64), len(prompt))[0]]
    for token in continuation:
        rows.append(session.forward(state, np.asarray([[token]], dtype=np.int64), 1)[0])
    return np.concatenate(rows)


def unchanged_export(path: str | Path, threads: int | None = None) -> Reference:
    """An export run with its ops as exported (no fast ops, no fusions, no decode plan, all logits)."""
    from onnxgen.model import ModelPackage
    from onnxgen.runtime.graph_cache import session_graph
    from onnxgen.runtime.session import DecoderSession

    package = ModelPackage.open(path)
    session = DecoderSession(
        session_graph(
            package.model_path, package.io, graph=package.graph, last_logits=False, fast_ops=False, fuse=False
        ),
        threads=threads,
        verify=False,
        inplace=False,
    )

    def run(prompt: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
        state = session.new_state(len(prompt) + new_tokens + 1)
        rows = [session.forward(state, np.asarray([prompt], dtype=np.int64))[0]]
        tokens: list[int] = []
        for _ in range(new_tokens):
            tokens.append(int(rows[-1][-1].argmax()))
            rows.append(session.forward(state, np.asarray([[tokens[-1]]], dtype=np.int64))[0])
        return tokens, np.concatenate(rows)

    return run


def transformers_checkpoint(path: str | Path) -> Reference:
    """A transformers checkpoint in float32 on the CPU (torch and transformers must be installed)."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise ValidationError(
            f"a transformers checkpoint as reference needs torch and transformers ({e}); "
            "pip install 'onnxgen[validate]', or give another export as --reference"
        ) from e
    config = transformers.AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    model = (cls or transformers.AutoModelForCausalLM).from_pretrained(path, dtype=torch.float32).eval()

    def logits(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        return out.float().numpy()

    def run(prompt: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
        seq = list(prompt)
        for _ in range(new_tokens):  # full forwards: the argmax below is the one compared
            seq.append(int(logits(seq)[-1].argmax()))
        return seq[len(prompt) :], logits(seq)

    return run


def reference_for(path: str | Path, threads: int | None = None) -> tuple[Reference, str, bool]:
    """The reference at ``path``, what it is and whether it is quantized: an ONNX export (a directory with
    an .onnx model, or the file) or a transformers checkpoint (``config.json`` and weights, no .onnx)."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ValidationError(f"reference {root} does not exist; give an export directory or a checkpoint")
    onnx_files = [root] if root.is_file() else sorted(root.glob("*.onnx")) + sorted(root.glob("*/*.onnx"))
    if onnx_files or (root / "manifest.json").is_file():
        from onnxgen.model import ModelPackage

        quantized = is_quantized(ModelPackage.open(root))
        return unchanged_export(root, threads), f"export {root} (ops as exported)", quantized
    if (root / "config.json").is_file():
        return transformers_checkpoint(root), f"transformers checkpoint {root}", False
    raise ValidationError(
        f"{root} holds neither an ONNX export nor a transformers checkpoint (config.json and weights)"
    )


# -- the run ---------------------------------------------------------------------------------------


def encode_prompts(prompts: Sequence[str], tokenizer: Any | None, vocab: int) -> list[list[int]]:
    """Each prompt as token ids: a line of space-separated integers is taken as ids, text is encoded."""
    out = []
    for i, text in enumerate(prompts):
        parts = text.split()
        if parts and all(p.isdigit() for p in parts):
            ids = [int(p) for p in parts]
        elif tokenizer is None:
            raise ValidationError(
                f"prompt {i} is text but the export has no tokenizer.json; give prompts as token ids "
                "(a line of space-separated integers per prompt)"
            )
        else:
            ids = tokenizer.encode(text)
        if not ids or max(ids) >= vocab or min(ids) < 0:
            raise ValidationError(f"prompt {i} gives token ids outside [0, {vocab}) or none at all")
        out.append(ids)
    return out


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: one per non-empty line (``\\n`` inside a line stands for a line break)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValidationError(f"--prompts {path} cannot be read ({e}); give a UTF-8 text file") from e
    prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
    if not prompts:
        raise ValidationError(f"--prompts {path} has no prompt (one per non-empty line)")
    return prompts


def validate(
    export: str | Path,
    reference: str | Path | None = None,
    *,
    self_check: bool = False,
    prompts: Sequence[str] = PROMPTS,
    new_tokens: int = DEFAULT_NEW_TOKENS,
    thresholds: Mapping[str, Any] | None = None,
    threads: int | None = None,
    decode_plan: str = "auto",
    fast_ops: bool | None = None,
) -> Report:
    """Compare ``export`` (run as :func:`onnxgen.load` runs it) with ``reference`` (or, with
    ``self_check``, with itself run with its ops as exported) over ``prompts``. ``thresholds`` overrides
    fields of :func:`default_thresholds`' choice."""
    from onnxgen.llm import load
    from onnxgen.model.sources import resolve_model

    if (reference is None) == (not self_check):
        raise ValueError("give a reference or self_check=True (--reference or --self), not both or neither")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1 (got {new_tokens})")
    export = resolve_model(export)  # a pulled name, a hub id, a GGUF file: the directory it names
    llm = load(export, threads=threads, decode_plan=decode_plan, fast_ops=fast_ops)
    quantized = is_quantized(llm.package)
    if self_check:
        ref, what, ref_quantized = (
            unchanged_export(export, threads),
            "itself with its ops as exported",
            quantized,
        )
    else:
        assert reference is not None
        ref, what, ref_quantized = reference_for(reference, threads)
    limits = replace(default_thresholds(quantized, ref_quantized), **(thresholds or {}))
    report = Report(what, limits)
    for ids in encode_prompts(prompts, llm.tokenizer, llm.session.vocab_size):
        continuation, ref_logits = ref(ids, new_tokens)
        got = export_logits(llm, ids, continuation)
        report.prompts.append(compare(ref_logits, got, len(ids)))
    ran = llm.decode_plan.plan.settle()  # the decode steps above ran the check, where there is one
    report.decode_plan, report.decode_plan_reason = ran.plan, ran.reason
    return report


def format_report(report: Report) -> str:
    t = report.thresholds
    limits = f"top-1 >= {t.min_top1}, mean KL <= {t.max_kl}" + (
        f", max|Δ| <= {t.max_abs}" if t.max_abs else ""
    )
    lines = [f"reference: {report.reference}", f"thresholds ({t.kind}): {limits}"]
    if report.decode_plan:
        lines.append(f"decode plan: {report.decode_plan} ({report.decode_plan_reason})")
    for i, p in enumerate(report.prompts):
        parts = "never" if p.greedy_parts_at is None else f"at new token {p.greedy_parts_at}"
        lines.append(
            f"prompt {i}: {p.prompt_tokens} + {p.new_tokens} tokens  top-1 {p.top1:.3f}  max|Δ| {p.max_abs:.3g}  "
            f"mean KL {p.mean_kl:.3g}  greedy parts {parts}"
        )
    lines.append(
        f"overall: top-1 {report.top1:.4f}  max|Δ| {report.max_abs:.3g}  mean KL {report.mean_kl:.3g}"
    )
    failures = report.failures()
    lines.extend(f"FAIL: {f}" for f in failures)
    lines.append("FAILED" if failures else "PASSED")
    return "\n".join(lines)
