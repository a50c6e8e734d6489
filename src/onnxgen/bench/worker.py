"""The process plumbing of ``onnxgen bench``: a worker serving JSON-line commands, and its client.

Protocol (one JSON object per line). The worker starts with ``ENGINE MODEL THREADS [OPTIONS_JSON]`` as
arguments (options: the engine's settings, e.g. ``{"decode_plan": "inline", "speculative": {...}}``),
loads the engine and answers ``{"ready": true, ...facts}`` with ``load_s`` (the engine's load call),
``rss_load_mb`` (resident memory right after it) and ``peak_load_mb`` (the most resident memory so far)
(or ``{"error": ...}`` and exits). Then for each ``{"cmd": "run", "prompt": [...], "new_tokens": N,
"speculative": false}`` it answers the run's timings plus ``peak_rss_mb``, ``rss_mb`` (now) and ``pss_mb``; ``{"cmd": "encode", "text": ..., "special": true}`` answers
``{"token_ids": [...]}`` (engines with a tokenizer); ``{"cmd": "exit"}`` (or end of input) ends it. The
worker moves its own stdout to stderr at start, so nothing a library prints can corrupt the protocol stream.

Each engine's worker imports what that engine's user would: the onnxruntime-genai worker starts from
:func:`genai_worker_main`, which loads nothing of onnxgen's engine (nor onnx), so its memory is its own.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from onnxgen.bench.genai_engine import GENAI, BenchError, GenaiEngine

WORKER_CODE = {
    GENAI: "from onnxgen.bench.worker import genai_worker_main; raise SystemExit(genai_worker_main())",
    "onnxgen": "from onnxgen.bench.onnxgen_engine import worker_main; raise SystemExit(worker_main())",
}


class Engine(Protocol):
    def info(self) -> dict[str, Any]: ...

    def run(self, prompt: Sequence[int], new_tokens: int) -> dict[str, Any]: ...


EngineFactory = Callable[[str, str, int, dict[str, Any]], Engine]


def peak_rss_mb() -> float | None:
    """This process's peak resident set size in MiB, None where unavailable: the largest of ``ru_maxrss``,
    ``VmHWM`` and the resident size now (Linux updates the first lazily, so alone it can read below the
    current ``VmRSS``)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not Unix
        return None
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = kib / (1024.0 * 1024.0) if sys.platform == "darwin" else kib / 1024.0  # bytes on macOS
    return max(v for v in (peak, _proc_mb("/proc/self/status", "VmHWM"), rss_mb()) if v is not None)


def _proc_mb(path: str, key: str) -> float | None:
    """The kB field ``key`` of the /proc file ``path`` in MiB, None where unreadable."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError:
        return None
    line = next((ln for ln in text.splitlines() if ln.startswith(f"{key}:")), None)
    return int(line.split()[1]) / 1024.0 if line is not None else None


def rss_mb() -> float | None:
    """This process's resident set size in MiB now (``VmRSS``), None where unreadable."""
    return _proc_mb("/proc/self/status", "VmRSS")


def pss_mb() -> float | None:
    """This process's proportional set size in MiB now (shared pages divided among their mappers), from
    ``/proc/self/smaps_rollup``; None where unreadable."""
    return _proc_mb("/proc/self/smaps_rollup", "Pss")


def process_threads() -> int | None:
    """OS threads of this process (Linux), to show that the thread setting took effect."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # pragma: no cover - not Linux
        return None


def machine_info() -> dict[str, Any]:
    from onnxgen.runtime.session import default_threads  # the parent's only: workers stay light

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:  # pragma: no cover - not Linux
        pass
    return {
        "cpu": cpu,
        "cores_available": default_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "onnxruntime": _version("onnxruntime"),
        "loadavg_start": list(os.getloadavg()),
    }


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def _answer(engine: Engine, command: dict[str, Any]) -> dict[str, Any]:
    if command["cmd"] == "encode":
        encode = getattr(engine, "encode", None)
        if encode is None:
            return {"error": f"{type(engine).__name__} has no tokenizer to encode text with"}
        return {"token_ids": encode(command["text"], bool(command.get("special", True)))}
    prompt, new_tokens = command["prompt"], int(command["new_tokens"])
    extra = {k: command[k] for k in ("speculative", "constraint") if command.get(k)}
    # only onnxgen engines speculate or constrain (the parent never asks another)
    result = engine.run(prompt, new_tokens, **extra)
    return {**result, "peak_rss_mb": peak_rss_mb(), "rss_mb": rss_mb(), "pss_mb": pss_mb()}


def serve(factory: EngineFactory, argv: Sequence[str] | None = None) -> int:
    """The worker's main loop (runs in the subprocess)."""
    args = sys.argv[1:] if argv is None else list(argv)
    engine_name, model, threads = args[:3]
    options = json.loads(args[3]) if len(args) > 3 else {}
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)

    def reply(message: dict[str, Any]) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    try:
        start = time.perf_counter()
        engine = factory(engine_name, model, int(threads), options)
        load_s = time.perf_counter() - start
    except Exception as e:  # reported to the parent, which raises it as a BenchError
        reply({"error": f"{type(e).__name__}: {e}"})
        return 1
    facts = {"load_s": load_s, "rss_load_mb": rss_mb(), "peak_load_mb": peak_rss_mb()}
    # an engine that timed its own load call (apart from work it waited for after it) reports that
    reply({"ready": True, **facts, **engine.info(), "process_threads": process_threads()})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("cmd") not in ("run", "encode"):
            break
        try:
            reply(_answer(engine, command))
        except Exception as e:  # reported to the parent
            reply({"error": f"{type(e).__name__}: {e}"})
    return 0


def genai_worker_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of an onnxruntime-genai worker subprocess."""
    return serve(lambda name, model, threads, options: GenaiEngine(model, threads), argv)


class Worker:
    """The parent's handle on one worker subprocess; ``label`` names it in reports (default: the engine)."""

    def __init__(
        self,
        engine: str,
        model: str | Path,
        threads: int,
        options: dict[str, Any] | None = None,
        label: str | None = None,
    ) -> None:
        self.engine = engine
        self.label = label or engine
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])  # so the child imports this onnxgen
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                WORKER_CODE.get(engine, WORKER_CODE["onnxgen"]),
                engine,
                str(model),
                str(threads),
                json.dumps(options or {}),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            env=env,
        )
        self.info = self._receive()

    def _receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            status = self.proc.wait()
            raise BenchError(f"the {self.label} worker exited with status {status}; its messages are above")
        message = json.loads(line)
        if "error" in message:
            raise BenchError(f"{self.label} worker: {message['error']}")
        return message

    def _ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._receive()

    def run(
        self, prompt: Sequence[int], new_tokens: int, speculative: bool = False, constraint: str | None = None
    ) -> dict[str, Any]:
        return self._ask(
            {
                "cmd": "run",
                "prompt": list(prompt),
                "new_tokens": new_tokens,
                "speculative": speculative,
                "constraint": constraint,
            }
        )

    def encode(self, text: str, special: bool = True) -> list[int]:
        """``text`` encoded by the worker's tokenizer."""
        return [int(i) for i in self._ask({"cmd": "encode", "text": text, "special": special})["token_ids"]]

    def close(self) -> None:
        try:
            if self.proc.stdin is not None and self.proc.poll() is None:
                self.proc.stdin.write('{"cmd": "exit"}\n')
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
