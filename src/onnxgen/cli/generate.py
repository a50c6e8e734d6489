"""``onnxgen generate [MODEL] PROMPT``: one completion, streamed to stdout, stats on stderr.

Also home of what ``chat`` and ``bench`` share: the model/threads flags with their environment
fallbacks (``ONNXGEN_MODEL``, ``ONNXGEN_THREADS``), the sampling flags (one per
:class:`~onnxgen.generation.params.SamplingParams` field) and the stream writer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from onnxgen.cli.speculative import add_speculative_flags, format_speculative_stats, speculative_from_args
from onnxgen.config import MODEL, THREADS, EngineConfig, env_model, env_threads
from onnxgen.errors import GenerationError, ModelPackageError, TokenizerError
from onnxgen.generation.params import SamplingParams, SamplingParamsError
from onnxgen.runtime.plan_names import DECODE_PLANS

if TYPE_CHECKING:  # onnx and onnxruntime load after the arguments are parsed (main imports them lazily)
    from onnxgen.generation.generator import GenerationResult, StreamEvent
    from onnxgen.llm import LLM

MODEL_ENV = MODEL
MODEL_HELP = "model directory, .onnx or .gguf file, name from `onnxgen pull`, or hub id ORG/REPO"
THREADS_ENV = THREADS

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


# What generate and chat sample with unless told otherwise: llama.cpp's temperature, top-k, top-p and min-p
# and ollama's repetition penalty (users of both expect them; the penalty keeps small models out of loops).
# --temp 0 (greedy) drops them all, so `--temp 0` gives the library's greedy tokens.
SAMPLING_DEFAULTS: dict[str, float | int] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
}
SAMPLING_DEFAULT_FLAGS = (
    ("--temp", 0.8),
    ("--top-k", 40),
    ("--top-p", 0.95),
    ("--min-p", 0.05),
    ("--repetition-penalty", 1.1),
)
# library words in SamplingParams' messages -> what a command-line user does instead
_CLI_HINTS = {"seed": "omit --seed for a random seed"}


# -- shared flags ---------------------------------------------------------------------------------
def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-t",
        "--threads",
        type=int,
        default=None,
        help=f"intra-op threads (env {THREADS_ENV}; default: all cores)",
    )
    p.add_argument(
        "--decode-plan",
        choices=DECODE_PLANS,
        default="auto",
        help="how a Scan-based hybrid runs single-token steps: its Scans inlined in a sibling session "
        "(inline), as exported (scan), or whichever the model gains from (auto, default)",
    )
    add_fast_ops_flag(p)


def add_prefix_cache_flags(p: argparse.ArgumentParser, default_mb: float | None) -> None:
    """``--prefix-cache-mb`` and ``--checkpoint-interval`` (docs/prefix-cache.md); ``default_mb`` None: the
    engine's automatic budget."""
    default = "a tenth of the available memory, at most 1024" if default_mb is None else f"{default_mb:g}"
    p.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=default_mb,
        metavar="MB",
        help="MiB of prompts' and replies' KV rows and state checkpoints kept, so a request that shares a "
        f"prefix with an earlier one prefills only the rest; 0 turns it off (default: {default})",
    )
    p.add_argument(
        "--checkpoint-interval",
        type=int,
        default=None,
        metavar="TOKENS",
        help="tokens of a long prefill between two cached checkpoints of a hybrid's recurrent states "
        "(default 256)",
    )


def add_fast_ops_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fast-ops",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run a hybrid's GatedRMSNorm and fused CausalConvWithState on onnxruntime's vectorized kernels "
        "(same math, rounded differently); default: on unless the export quantizes activations to int8 "
        "(env ONNXGEN_FAST_OPS)",
    )


def add_sampling_flags(p: argparse.ArgumentParser, max_new_tokens: str = "64") -> None:
    """One flag per SamplingParams field; values are validated by SamplingParams itself. ``max_new_tokens``
    says the command's default in the help."""
    g = p.add_argument_group(
        "sampling (defaults as in llama.cpp and ollama: "
        + ", ".join(f"{flag} {value}" for flag, value in SAMPLING_DEFAULT_FLAGS)
        + "; --temp 0 decodes greedily, without those filters and penalty)"
    )
    g.add_argument(
        "-n",
        "--max-new-tokens",
        "--n-predict",
        type=int,
        metavar="N",
        help=f"most tokens to generate (default {max_new_tokens})",
    )
    g.add_argument(
        "--temp",
        "--temperature",
        dest="temperature",
        type=float,
        metavar="T",
        help="softmax temperature; 0 = greedy",
    )
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens (0 disables)")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--min-p", type=float, help="drop tokens below min-p times the top probability")
    g.add_argument(
        "--repeat-penalty",
        "--repetition-penalty",
        dest="repetition_penalty",
        type=float,
        help="HF-style repetition penalty (1 disables)",
    )
    g.add_argument("--presence-penalty", type=float, help="OpenAI-style presence penalty in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, help="OpenAI-style frequency penalty in [-2, 2]")
    g.add_argument("-s", "--seed", type=int, help="seed of the sampler, an integer >= 0 (default: random)")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="keep going past end-of-sequence")
    g.add_argument("--min-new-tokens", type=int, help="mask end-of-sequence until this many tokens")


def add_chat_template_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="render chats with this Jinja chat template file instead of the model's own "
        "(tokenizer_config.json or chat_template.jinja)",
    )


def chat_template_text(args: argparse.Namespace) -> str | None:
    """The contents of ``--chat-template FILE`` (None without the flag)."""
    path = getattr(args, "chat_template", None)
    return None if path is None else _read_flag_file("--chat-template", path, "a Jinja chat template")


def check_chat_template(llm: LLM) -> None:
    """A model that cannot render a chat, said once it is loaded rather than at the first message."""
    if llm.tokenizer is None:
        raise TokenizerError(
            f"{llm.package.root} has no tokenizer.json, so it cannot chat; put the model's tokenizer.json "
            "beside it"
        )
    try:
        llm.tokenizer.check_chat_template()
    except TokenizerError as e:
        raise TokenizerError(f"{e}; or pass --chat-template FILE") from e


def add_constraint_flags(p: argparse.ArgumentParser) -> None:
    """``--json-schema FILE | --regex RE | --grammar FILE`` (one at a time)."""
    g = p.add_argument_group("constrained output (one of)").add_mutually_exclusive_group()
    g.add_argument(
        "--json-schema",
        metavar="FILE",
        help="output JSON valid under this JSON schema file (or inline {...})",
    )
    g.add_argument("--regex", metavar="RE", help="output text that matches this regular expression in full")
    g.add_argument(
        "--grammar",
        metavar="FILE",
        help="output text in this Lark grammar (rule `start`): a file, or inline text such as "
        '\'start: "yes" | "no"\'',
    )


def _read_flag_file(flag: str, value: str, inline: str) -> str:
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{flag} {value!r} cannot be read ({e}); give the path of a readable text file or {inline}"
        ) from e


def constraint_kwargs(args: argparse.Namespace) -> dict[str, str]:
    """The SamplingParams constraint the flags ask for (files read here; their contents are checked later)."""
    schema, regex, grammar = (getattr(args, name, None) for name in ("json_schema", "regex", "grammar"))
    if schema is not None:
        inline = schema.lstrip().startswith("{")
        return {
            "json_schema": schema
            if inline
            else _read_flag_file("--json-schema", schema, "the schema inline ({...})")
        }
    if regex is not None:
        return {"regex": regex}
    if grammar is not None:
        inline = ":" in grammar and not Path(grammar).is_file()  # a Lark rule is `name: ...`
        return {
            "grammar": grammar
            if inline
            else _read_flag_file("--grammar", grammar, "the grammar inline ('start: ...')")
        }
    return {}


def sampling_params(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The SamplingParams the flags ask for. ``defaults`` (e.g. :data:`SAMPLING_DEFAULTS`) fill the fields no
    flag set, except that ``--temp 0`` keeps the library's greedy defaults. A bad value is reported in flag
    words (``--seed must be ...``)."""
    given = {name: getattr(args, name) for name in _SAMPLING_FIELDS if getattr(args, name, None) is not None}
    if given.get("temperature") == 0:  # greedy: no sampling filters or penalty unless flags ask for them
        defaults = {k: v for k, v in (defaults or {}).items() if k not in SAMPLING_DEFAULTS}
    given = {**(defaults or {}), **given}
    constraint: dict[str, Any] = constraint_kwargs(args)
    try:
        return SamplingParams(**given, **constraint)
    except SamplingParamsError as e:
        if e.param not in _SAMPLING_FIELDS:
            raise
        flag = "--" + e.param.replace("_", "-")
        hint = _CLI_HINTS.get(e.param, e.hint)
        raise ValueError(f"{flag} must be {e.constraint} (got {e.value!r}); {hint}") from None


def resolve_threads(value: int | None) -> int | None:
    """``--threads``, else ``$ONNXGEN_THREADS``, else None (the runtime's default)."""
    if value is not None and value < 1:
        raise ValueError(f"--threads must be an integer >= 1 (got {value}); omit it to use all cores")
    return value if value is not None else env_threads()


def engine_config(args: argparse.Namespace, **settings: Any) -> EngineConfig:
    """The engine settings of the runtime flags (:func:`add_runtime_flags`) over the environment's, with
    ``settings`` (other :class:`EngineConfig` fields) on top."""
    names = ("decode_plan", "fast_ops", "prefix_cache_mb", "checkpoint_interval")
    flags = {name: getattr(args, name, None) for name in names}
    if hasattr(args, "prefix_cache_mb") and args.prefix_cache_mb is None:  # the flag's automatic default
        from onnxgen.cache.prefix import auto_prefix_cache_mb

        flags["prefix_cache_mb"] = auto_prefix_cache_mb()
    return EngineConfig.from_env(threads=resolve_threads(args.threads), **flags, **settings)


def resolve_model(model: str | None) -> Path:
    """The model directory (or file) of MODEL, else of ``$ONNXGEN_MODEL``, else the bundled default model
    (:func:`onnxgen.model.sources.resolve_model`: a directory, a .onnx or .gguf file, a pulled name, a hub
    id in the local cache)."""
    chosen = model or env_model()
    if chosen:
        from onnxgen.model.sources import resolve_model as resolve

        return resolve(chosen)
    from onnxgen.llm import default_model_dir

    default = default_model_dir()
    if not default.is_dir():
        raise ModelPackageError(
            f"no MODEL given and the bundled default model is missing ({default}); "
            f"pass a model directory or set ${MODEL_ENV}"
        )
    return default


def load_llm(args: argparse.Namespace, speculative: bool = False, log: TextIO | None = None) -> LLM:
    """Load the model the flags name; with ``log`` (a terminal), say what is loading and how long it took
    there (``[onnxgen] loading NAME ... 0.42 s``)."""
    template = chat_template_text(args)  # an unreadable file fails before the model loads
    model = resolve_model(args.model)
    config = engine_config(args, speculative=speculative)
    if log is not None:
        log.write(f"[onnxgen] loading {model_label(args.model or model)} ... ")
        log.flush()
    start = time.perf_counter()
    try:
        from onnxgen.llm import load  # onnx and onnxruntime: most of a small model's start-up

        llm = load(model, config, chat_template=template)
    except BaseException:
        if log is not None:
            log.write("\n")
        raise
    if log is not None:
        log.write(f"{time.perf_counter() - start:.2f} s\n")
        log.flush()
    return llm


def terminal_log(wanted: bool = True) -> TextIO | None:
    """stderr where it is a terminal (progress lines are for people; logs and pipes stay one line per
    error), else None."""
    return sys.stderr if wanted and sys.stderr.isatty() else None


def model_label(model: str | Path) -> str:
    """How messages name a model: its path, or "the bundled demo model"."""
    from onnxgen.llm import default_model_dir

    return "the bundled demo model" if Path(model) == default_model_dir() else str(model)


def clip_notice(result: GenerationResult, params: SamplingParams, context_length: int | None) -> str | None:
    """A line saying that ``-n`` was more than the context has room for, where the request was cut there."""
    generated = result.stats.get("generated_tokens", len(result.token_ids))
    if result.finish_reason != "length" or generated >= params.max_new_tokens or context_length is None:
        return None
    return (
        f"[onnxgen] -n {params.max_new_tokens} was clipped to {generated}: the prompt's "
        f"{result.stats.get('prompt_tokens', '?')} tokens and the new ones fill the model's "
        f"{context_length}-token context"
    )


# -- output ---------------------------------------------------------------------------------------
def write_stream(events: Iterable[StreamEvent], out: TextIO | None) -> GenerationResult:
    """Write each event's text to ``out`` as soon as it arrives (flushed); return the whole result once
    the stream is exhausted (a chat stream caches the next turn's opening tokens after its last event)."""
    from onnxgen.generation.generator import GenerationResult

    ids: list[int] = []
    parts: list[str] = []
    result: GenerationResult | None = None
    for event in events:
        ids.extend(event.token_ids)
        if event.text and out is not None:
            out.write(event.text)
            out.flush()
        parts.append(event.text)
        if event.finish_reason is not None and result is None:
            result = GenerationResult(ids, "".join(parts), event.finish_reason, event.stats or {})
    if result is None:
        raise GenerationError("the generation stream ended without a finish reason")
    return result


def format_stats(result: GenerationResult) -> str:
    """``[onnxgen] prompt P tokens | generated G tokens | TTFT T ms | decode R tok/s | finish F``; the decode
    rate is ``n/a`` where fewer than two tokens were generated (the first token is the prefill's)."""
    s = result.stats
    generated = s.get("generated_tokens", len(result.token_ids))
    rate = f"{s.get('decode_tok_s', 0.0):.1f} tok/s" if generated > 1 else "n/a"
    return (
        f"[onnxgen] prompt {s.get('prompt_tokens', '?')} tokens"
        + (f" ({s['cached_tokens']} cached)" if s.get("cached_tokens") else "")
        + f" | generated {generated} tokens | "
        f"TTFT {1000.0 * s.get('ttft_s', 0.0):.1f} ms | decode {rate} | finish {result.finish_reason}"
    ) + format_speculative_stats(s)


# -- generate -------------------------------------------------------------------------------------
def add_generate(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser(
        "generate",
        help=help_text,
        description="Generate a completion of PROMPT (use - to read it from stdin). With one positional "
        f"argument it is the prompt and the model is ${MODEL_ENV} or the bundled default model, unless it "
        "is an existing directory or model file: then the prompt is missing.",
    )
    p.add_argument("model", nargs="?", help=f"{MODEL_HELP} (default: ${MODEL_ENV}, then the bundled model)")
    p.add_argument("prompt", help="prompt text, or - to read stdin")
    add_runtime_flags(p)
    add_prefix_cache_flags(p, 0)
    add_sampling_flags(p)
    add_constraint_flags(p)
    add_speculative_flags(p)
    p.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="print text as it is produced (default; with --json: one JSON line per piece of text)",
    )
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--system", metavar="TEXT", help="system message (implies --chat)")
    add_chat_template_flag(p)
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: text, token_ids, finish_reason, stats (no stats line); with --stream, "
        'one JSON line per piece of text ({"text", "token_ids"}) and a last line with finish_reason and stats',
    )
    p.add_argument(
        "--stats",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="say on stderr what is loading and, after the text, a stats line",
    )
    p.set_defaults(run=_run, take_extra_positional=_take_extra_positional)


def _take_extra_positional(args: argparse.Namespace, extra: str) -> bool:
    """``generate MODEL -n 5 PROMPT``: argparse reads MODEL as the prompt and leaves PROMPT over."""
    if args.model is not None:
        return False
    args.model, args.prompt = args.prompt, extra
    return True


MODEL_SUFFIXES = (".onnx", ".gguf")


def looks_like_model(text: str) -> bool:
    """True for an existing directory or model file (``.onnx``, ``.gguf``): a first positional that is one
    names the model, never the prompt."""
    path = Path(text).expanduser()
    return path.is_dir() or (path.suffix.lower() in MODEL_SUFFIXES and path.is_file())


def check_prompt_given(args: argparse.Namespace) -> None:
    """``generate MODEL -n 8`` (the prompt forgotten): argparse reads MODEL as the prompt."""
    if args.model is None and args.prompt != "-" and looks_like_model(args.prompt):
        raise ValueError(
            f"no prompt given: {args.prompt!r} is a model, not a prompt; pass the prompt after it "
            f'(onnxgen generate {args.prompt} "PROMPT"), or - to read it from stdin'
        )


def _read_prompt(prompt: str) -> str:
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        raise GenerationError("the prompt is empty; give non-empty text (or pipe it in with PROMPT = -)")
    return text


def chat_messages(prompt: str, system: str | None) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": system}] if system is not None else []
    return [*messages, {"role": "user", "content": prompt}]


def _run(args: argparse.Namespace) -> int:
    check_prompt_given(args)
    prompt = _read_prompt(args.prompt)
    params = sampling_params(args, SAMPLING_DEFAULTS)
    spec = speculative_from_args(args)
    llm = load_llm(args, speculative=spec is not None, log=terminal_log(args.stats and not args.json))
    chat = args.chat or args.system is not None
    if chat:
        check_chat_template(llm)
    messages = chat_messages(prompt, args.system)
    if args.json and not args.stream:
        result = llm.chat(messages, params, spec) if chat else llm.generate(prompt, params, spec)
        print(json.dumps(_json_fields(result), ensure_ascii=False))
        return 0
    events = llm.stream_chat(messages, params, spec) if chat else llm.stream(prompt, params, spec)
    out = sys.stdout
    if args.json:
        result = write_json_lines(events, out)
    elif args.stream is not False:
        result = write_stream(events, out)
    else:
        result = write_stream(events, None)
        out.write(result.text)
    if not args.json:
        out.write("\n")
        out.flush()
    notice = clip_notice(result, params, llm.package.context_length)
    if notice is not None:
        print(notice, file=sys.stderr)
    if args.stats and not args.json:
        print(format_stats(result), file=sys.stderr)
    return 0


def _json_fields(result: GenerationResult) -> dict[str, Any]:
    return {
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "stats": result.stats,
    }


def write_json_lines(events: Iterable[StreamEvent], out: TextIO) -> GenerationResult:
    """``--stream --json``: one JSON line per event, ``{"text", "token_ids"}``, flushed as it arrives; the
    last line adds ``finish_reason`` and ``stats``."""
    from onnxgen.generation.generator import GenerationResult

    ids: list[int] = []
    parts: list[str] = []
    for event in events:
        ids.extend(event.token_ids)
        parts.append(event.text)
        line: dict[str, Any] = {"text": event.text, "token_ids": list(event.token_ids)}
        if event.finish_reason is not None:
            line.update(finish_reason=event.finish_reason, stats=event.stats or {})
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
        out.flush()
        if event.finish_reason is not None:
            return GenerationResult(ids, "".join(parts), event.finish_reason, event.stats or {})
    raise GenerationError("the generation stream ended without a finish reason")
