"""``onnxgen generate [MODEL] PROMPT``: one completion, streamed to stdout, stats on stderr.

Also home of what ``chat`` and ``bench`` share: the model/threads flags with their environment
fallbacks (``ONNXGEN_MODEL``, ``ONNXGEN_THREADS``), the sampling flags (one per
:class:`~onnxgen.generation.params.SamplingParams` field) and the stream writer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from onnxgen.cli_speculative import add_speculative_flags, format_speculative_stats, speculative_from_args
from onnxgen.errors import GenerationError, ModelPackageError
from onnxgen.generation.generator import GenerationResult, StreamEvent
from onnxgen.generation.params import SamplingParams
from onnxgen.llm import LLM, default_model_dir, load
from onnxgen.runtime.plans import DECODE_PLANS

MODEL_ENV = "ONNXGEN_MODEL"
THREADS_ENV = "ONNXGEN_THREADS"

# flag dest -> SamplingParams field (same names); unset flags keep the SamplingParams defaults.
_SAMPLING_FIELDS = (
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "ignore_eos",
    "min_new_tokens",
)


# -- shared flags ---------------------------------------------------------------------------------
def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads", type=int, default=None, help=f"intra-op threads (env {THREADS_ENV}; default: all cores)"
    )
    p.add_argument(
        "--decode-plan",
        choices=DECODE_PLANS,
        default="auto",
        help="how a Scan-based hybrid runs single-token steps: its Scans inlined in a sibling session "
        "(inline), as exported (scan), or whichever the model gains from (auto, default)",
    )
    add_fast_ops_flag(p)


def add_fast_ops_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fast-ops",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run a hybrid's GatedRMSNorm and fused CausalConvWithState on onnxruntime's vectorized kernels "
        "(same math, rounded differently); default: on unless the export quantizes activations to int8 "
        "(env ONNXGEN_FAST_OPS)",
    )


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field; values are validated by SamplingParams itself."""
    g = p.add_argument_group("sampling (defaults: greedy, 64 new tokens)")
    g.add_argument("-n", "--max-new-tokens", type=int, help="most tokens to generate")
    g.add_argument("-t", "--temperature", type=float, help="softmax temperature; 0 = greedy")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens (0 disables)")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--min-p", type=float, help="drop tokens below min-p times the top probability")
    g.add_argument("--repetition-penalty", type=float, help="HF-style repetition penalty (1 disables)")
    g.add_argument("--presence-penalty", type=float, help="OpenAI-style presence penalty in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, help="OpenAI-style frequency penalty in [-2, 2]")
    g.add_argument("--seed", type=int, help="seed of the sampler (default: random)")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="keep going past end-of-sequence")
    g.add_argument("--min-new-tokens", type=int, help="mask end-of-sequence until this many tokens")


def add_constraint_flags(p: argparse.ArgumentParser) -> None:
    """``--json-schema FILE | --regex RE | --grammar FILE`` (one at a time)."""
    g = p.add_argument_group("constrained output (one of)").add_mutually_exclusive_group()
    g.add_argument(
        "--json-schema",
        metavar="FILE",
        help="output JSON valid under this JSON schema file (or inline {...})",
    )
    g.add_argument("--regex", metavar="RE", help="output text that matches this regular expression in full")
    g.add_argument("--grammar", metavar="FILE", help="output text in this Lark grammar file (rule `start`)")


def _read_flag_file(flag: str, value: str) -> str:
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{flag} {value!r} cannot be read ({e}); give the path of a readable text file"
        ) from e


def constraint_kwargs(args: argparse.Namespace) -> dict[str, str]:
    """The SamplingParams constraint the flags ask for (files read here; their contents are checked later)."""
    schema, regex, grammar = (getattr(args, name, None) for name in ("json_schema", "regex", "grammar"))
    if schema is not None:
        inline = schema.lstrip().startswith("{")
        return {"json_schema": schema if inline else _read_flag_file("--json-schema", schema)}
    if regex is not None:
        return {"regex": regex}
    if grammar is not None:
        return {"grammar": _read_flag_file("--grammar", grammar)}
    return {}


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    given = {name: getattr(args, name) for name in _SAMPLING_FIELDS if getattr(args, name, None) is not None}
    return SamplingParams(**given, **constraint_kwargs(args))


def resolve_threads(value: int | None) -> int | None:
    """``--threads``, else ``$ONNXGEN_THREADS``, else None (the runtime's default)."""
    source = "--threads"
    if value is None:
        env = os.environ.get(THREADS_ENV, "").strip()
        if not env:
            return None
        source = f"${THREADS_ENV}"
        try:
            value = int(env)
        except ValueError:
            raise ValueError(
                f"{source} must be an integer >= 1 (got {env!r}); unset it or give a count"
            ) from None
    if value < 1:
        raise ValueError(f"{source} must be an integer >= 1 (got {value}); omit it to use all cores")
    return value


def resolve_model(model: str | None) -> str | Path:
    """MODEL, else ``$ONNXGEN_MODEL``, else the bundled default model."""
    chosen = model or os.environ.get(MODEL_ENV, "").strip()
    if chosen:
        return chosen
    default = default_model_dir()
    if not default.is_dir():
        raise ModelPackageError(
            f"no MODEL given and the bundled default model is missing ({default}); "
            f"pass a model directory or set ${MODEL_ENV}"
        )
    return default


def load_llm(args: argparse.Namespace, speculative: bool = False) -> LLM:
    return load(
        resolve_model(args.model),
        threads=resolve_threads(args.threads),
        speculative=speculative,
        decode_plan=args.decode_plan,
        fast_ops=args.fast_ops,
    )


# -- output ---------------------------------------------------------------------------------------
def write_stream(events: Iterable[StreamEvent], out: TextIO | None) -> GenerationResult:
    """Write each event's text to ``out`` as soon as it arrives (flushed); return the whole result."""
    ids: list[int] = []
    parts: list[str] = []
    for event in events:
        ids.extend(event.token_ids)
        if event.text and out is not None:
            out.write(event.text)
            out.flush()
        parts.append(event.text)
        if event.finish_reason is not None:
            return GenerationResult(ids, "".join(parts), event.finish_reason, event.stats or {})
    raise GenerationError("the generation stream ended without a finish reason")


def format_stats(result: GenerationResult) -> str:
    s = result.stats
    return (
        f"[onnxgen] prompt {s.get('prompt_tokens', '?')} tokens | "
        f"generated {s.get('generated_tokens', len(result.token_ids))} tokens | "
        f"TTFT {1000.0 * s.get('ttft_s', 0.0):.1f} ms | "
        f"decode {s.get('decode_tok_s', 0.0):.1f} tok/s | finish {result.finish_reason}"
    ) + format_speculative_stats(s)


# -- generate -------------------------------------------------------------------------------------
def add_generate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "generate",
        help="generate a completion of PROMPT",
        description="Generate a completion of PROMPT (use - to read it from stdin). With one positional "
        f"argument it is the prompt and the model is ${MODEL_ENV} or the bundled default model.",
    )
    p.add_argument(
        "model", nargs="?", help=f"model directory (default: ${MODEL_ENV}, then the bundled model)"
    )
    p.add_argument("prompt", help="prompt text, or - to read stdin")
    add_runtime_flags(p)
    add_sampling_flags(p)
    add_constraint_flags(p)
    add_speculative_flags(p)
    p.add_argument(
        "--stream", action=argparse.BooleanOptionalAction, default=True, help="print text as it is produced"
    )
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--system", metavar="TEXT", help="system message (implies --chat)")
    p.add_argument("--json", action="store_true", help="print one JSON object (no streaming, no stats line)")
    p.add_argument(
        "--stats", action=argparse.BooleanOptionalAction, default=True, help="print a stats line on stderr"
    )
    p.set_defaults(run=_run, take_extra_positional=_take_extra_positional)


def _take_extra_positional(args: argparse.Namespace, extra: str) -> bool:
    """``generate MODEL -n 5 PROMPT``: argparse reads MODEL as the prompt and leaves PROMPT over."""
    if args.model is not None:
        return False
    args.model, args.prompt = args.prompt, extra
    return True


def _read_prompt(prompt: str) -> str:
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        raise GenerationError("the prompt is empty; give non-empty text (or pipe it in with PROMPT = -)")
    return text


def chat_messages(prompt: str, system: str | None) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": system}] if system is not None else []
    return [*messages, {"role": "user", "content": prompt}]


def _run(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args.prompt)
    params = sampling_params(args)
    spec = speculative_from_args(args)
    llm = load_llm(args, speculative=spec is not None)
    chat = args.chat or args.system is not None
    messages = chat_messages(prompt, args.system)
    if args.json:
        result = llm.chat(messages, params, spec) if chat else llm.generate(prompt, params, spec)
        fields = {
            "text": result.text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "stats": result.stats,
        }
        print(json.dumps(fields, ensure_ascii=False))
        return 0
    events = llm.stream_chat(messages, params, spec) if chat else llm.stream(prompt, params, spec)
    out = sys.stdout
    if args.stream:
        result = write_stream(events, out)
    else:
        result = write_stream(events, None)
        out.write(result.text)
    out.write("\n")
    out.flush()
    if args.stats:
        print(format_stats(result), file=sys.stderr)
    return 0
