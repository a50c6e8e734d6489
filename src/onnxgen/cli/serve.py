"""``onnxgen serve [MODEL] --host 127.0.0.1 --port 8000``: an OpenAI-compatible server with batched decoding.

Also runnable as ``python -m onnxgen.cli.serve MODEL ...``. The port is bound before the model loads (a
port in use is an error at once) and answers 503 while it loads; "listening" is printed only once the
server accepts requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onnxgen.cli.generate import (
    MODEL_ENV,
    MODEL_HELP,
    add_chat_template_flag,
    add_prefix_cache_flags,
    add_runtime_flags,
    chat_template_text,
    resolve_model,
    resolve_threads,
)
from onnxgen.cli.speculative import add_speculative_flags
from onnxgen.config import API_KEY, env_api_key
from onnxgen.errors import OnnxgenError
from onnxgen.server.cache_scope import CACHE_SCOPES, DEFAULT_CACHE_SCOPE
from onnxgen.server.connections import (
    HEADER_TIMEOUT_S,
    KEEP_ALIVE_S,
    MAX_CONNECTIONS,
    SHUTDOWN_TIMEOUT_S,
    ConnectionLimits,
)
from onnxgen.serving.engine import EngineSpec, load_app

if TYPE_CHECKING:
    from onnxgen.server.security import SecurityConfig

API_KEY_ENV = API_KEY
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_serve(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("serve", help=help_text)
    _add_arguments(p)
    p.set_defaults(run=_run)


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help=f"{MODEL_HELP} (env {MODEL_ENV}; default: the bundled model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--served-model-name", help="model id clients pass (default: the model directory's name)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together (default 16)")
    p.add_argument("--max-queue", type=int, default=64, help="prompts that may wait before 503s (default 64)")
    p.add_argument(
        "-c",
        "--ctx-size",
        "--max-model-len",
        dest="max_model_len",
        type=int,
        metavar="TOKENS",
        help="tokens per sequence, prompt + generated (default: the model's context, cut to what a quarter of "
        "the available memory holds for --max-batch rows of KV cache; the start-up lines say so when cut)",
    )
    p.add_argument(
        "--prefill-chunk", type=int, default=512, help="prompt tokens prefilled between decode steps"
    )
    p.add_argument(
        "--batch-prefill",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="prefill the equal-length prompts of one scheduler iteration in one multi-row forward, with "
        "the same results (default: one prompt a forward; on CPU it has not paid, and it holds up to "
        "--max-batch rows of prefill state)",
    )
    p.add_argument(
        "--no-spinning",
        dest="spinning",
        action="store_const",
        const=False,
        help="let onnxruntime's threads sleep between parallel sections instead of spinning: faster where "
        "other processes share the cores (default: spinning, or $ONNXGEN_SPINNING)",
    )
    p.add_argument(
        "--min-batch-rows",
        default="auto",
        help="pad every decode step to this many rows; auto (default): 2 where the export's int4 kernels "
        "(MatMulNBits) compute a lone row differently from a block on this CPU (probed at start), so "
        "a request gets the same tokens alone or beside others; else 1",
    )
    add_chat_template_flag(p)
    p.add_argument(
        "--tool-call-parser",
        help="tool-call format of the model's replies: hermes or qwen3_coder (default: from the chat template)",
    )
    security = p.add_argument_group("security")
    security.add_argument(
        "--api-key",
        action="append",
        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every endpoint but /health; give "
        f"it once per user or team to let several keys in (default: ${API_KEY_ENV})",
    )
    security.add_argument(
        "--metrics-open",
        action="store_true",
        help="answer /metrics without the API key (for a Prometheus scraper; vLLM never asks a key there)",
    )
    security.add_argument(
        "--allowed-hosts",
        type=_names,
        default=(),
        help="comma-separated Host names answered besides the bound address and localhost ('*': any); "
        "guards against DNS rebinding",
    )
    security.add_argument(
        "--cors-origins",
        type=_names,
        default=(),
        help="comma-separated origins of web pages allowed to call the API from a browser ('*': any); "
        "default: none, cross-origin browser requests are refused",
    )
    security.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json")
    security.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_TIMEOUT_S,
        metavar="S",
        help="close a connection that sends no complete request headers within S seconds of connecting "
        f"or of its last response (default {HEADER_TIMEOUT_S:g})",
    )
    security.add_argument(
        "--keep-alive-timeout",
        type=int,
        default=KEEP_ALIVE_S,
        metavar="S",
        help=f"close a connection idle S seconds after a response (default {KEEP_ALIVE_S})",
    )
    security.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        metavar="N",
        help=f"answer 503 to requests beyond N open connections (default {MAX_CONNECTIONS})",
    )
    security.add_argument(
        "--shutdown-timeout",
        type=int,
        default=SHUTDOWN_TIMEOUT_S,
        metavar="S",
        help="after SIGTERM, let running requests finish for S seconds, then cut the connections still "
        f"open (default {SHUTDOWN_TIMEOUT_S})",
    )
    scale = p.add_argument_group("scale out on Ray Serve (pip install 'onnxgen[ray]'; docs/scale-out.md)")
    scale.add_argument(
        "--ray",
        action="store_true",
        help="serve engine replicas on Ray Serve behind one ingress, with prefix-aware routing",
    )
    scale.add_argument("--replicas", type=int, help="engine replicas (default 2; each --threads, default 1)")
    scale.add_argument("--min-replicas", type=int, help="autoscale: at least this many replicas")
    scale.add_argument("--max-replicas", type=int, help="autoscale: at most this many replicas")
    scale.add_argument(
        "--address",
        help="Ray cluster to deploy on: 'auto' (the one `ray start` began on this machine) or "
        "ray://HEAD:10001; default: a Ray instance started here",
    )
    p.add_argument(
        "--log-level", default="info", choices=LOG_LEVELS, help="one line per request at info (default)"
    )
    p.add_argument("--log-prompts", action="store_true", help="put each request's prompt into its log line")
    add_runtime_flags(p)
    add_prefix_cache_flags(p, 0)
    p.add_argument(
        "--prefix-cache-scope",
        choices=CACHE_SCOPES,
        default=DEFAULT_CACHE_SCOPE,
        help="which requests share cached prefixes: 'key' those of one API key (with no key: all), 'salt' "
        "only those sending the same cache_salt, 'shared' all; a request's cache_salt always separates "
        f"(default {DEFAULT_CACHE_SCOPE}; docs/prefix-cache.md)",
    )
    add_speculative_flags(p, "the default of every request (a request's `speculative` field overrides it)")


def _say(message: str) -> None:
    print(f"onnxgen serve: {message}", file=sys.stderr, flush=True)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, so that a port in use fails before the model loads."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise OnnxgenError(f"--host {host!r} cannot be resolved ({e.strerror}); pass an address") from e
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OnnxgenError(
            f"cannot listen on {host}:{port} ({e.strerror}); stop what uses the port or pick another "
            "with --port"
        ) from e
    return sock


def _engine_spec(
    args: argparse.Namespace, model: str, fixed_rows: int | None, security: SecurityConfig
) -> EngineSpec:
    return EngineSpec(
        model,
        threads=resolve_threads(args.threads),
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_model_len=args.max_model_len,
        prefill_chunk=args.prefill_chunk,
        min_rows=fixed_rows,
        batch_prefill=args.batch_prefill,
        served_model_name=args.served_model_name,
        security=security,
        log_prompts=args.log_prompts,
        tool_parser=args.tool_call_parser,
        chat_template=chat_template_text(args),
        prefix_cache_mb=args.prefix_cache_mb,
        checkpoint_interval=args.checkpoint_interval,
        prefix_cache_scope=args.prefix_cache_scope,
        decode_plan=args.decode_plan,
        fast_ops=args.fast_ops,
        spinning=args.spinning,
        speculative=args.speculative,
        draft_tokens=args.draft_tokens,
    )


def served_name(given: str | None, model: Path) -> str | None:
    """The model id clients pass when ``--served-model-name`` is not given: the name the user gave where it
    is not the model's own folder (a pulled name or hub id, whose folder is a cache's; a GGUF file, by its
    stem); None (the folder's name) otherwise."""
    if given is None or Path(given).expanduser() == model:
        return None
    return Path(given).stem if Path(given).expanduser().is_file() else given


def _check_scale_flags(args: argparse.Namespace) -> None:
    given = [
        f"--{name.replace('_', '-')}" for name in ("replicas", "min_replicas", "max_replicas", "address")
    ]
    given = [flag for flag in given if getattr(args, flag[2:].replace("-", "_")) is not None]
    if given and not args.ray:
        raise ValueError(f"{', '.join(given)} only apply with --ray; add --ray or drop them")
    if args.replicas is not None and (args.min_replicas is not None or args.max_replicas is not None):
        raise ValueError(
            "give either --replicas N (fixed) or --min-replicas/--max-replicas (autoscaling), not both"
        )


def _run_on_ray(args: argparse.Namespace, spec: EngineSpec) -> int:
    """Deploy ``spec``'s engine as Ray Serve replicas behind one ingress on --host:--port, until Ctrl-C."""
    try:
        from onnxgen.serving.ray import build_app, run_until_interrupted
    except ImportError as e:
        raise OnnxgenError(f"--ray needs Ray Serve ({e}); install it with: pip install 'onnxgen[ray]'") from e

    if args.threads is None and spec.threads is None:
        spec = dataclasses.replace(spec, threads=1)  # one replica per core unless told otherwise
    bind(args.host, args.port).close()  # a port in use is an error before Ray starts
    app = build_app(
        spec, replicas=args.replicas or 2, min_replicas=args.min_replicas, max_replicas=args.max_replicas
    )
    _log_requests(args.log_level)
    run_until_interrupted(app, args.host, args.port, args.address, _say)
    return 0


def _log_requests(level: str) -> None:
    """Server logs (one line per request, engine errors) to stderr at ``level``."""
    logger = logging.getLogger("onnxgen.server")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("onnxgen serve: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if level == "trace" else level.upper())
    logger.propagate = False


def _run(args: argparse.Namespace) -> int:
    import uvicorn

    from onnxgen.chat.parsers import tool_parser_for
    from onnxgen.server.loading import LoadingResponder
    from onnxgen.server.security import SecurityConfig

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535] (got {args.port})")
    fixed_rows = None if args.min_batch_rows == "auto" else _count(args.min_batch_rows)
    tool_parser_for(args.tool_call_parser)  # an unknown tool-call format is an error before the model
    limits = ConnectionLimits(
        args.header_timeout, args.keep_alive_timeout, args.max_connections, args.shutdown_timeout
    )  # a bad one is an error before the model loads
    api_key = tuple(args.api_key) if args.api_key is not None else env_api_key()
    security = SecurityConfig(
        args.host, api_key, args.allowed_hosts, args.cors_origins, args.docs, args.metrics_open
    )
    spec = _engine_spec(args, args.model or "", fixed_rows, security)
    spec.scheduler_config()  # a bad size is an error before the port and the model
    spec.speculative_spec()  # so is a bad --speculative
    model = resolve_model(args.model)  # a pulled name, a hub id, a GGUF file (converted): its directory
    spec = dataclasses.replace(
        spec, model=str(model), served_model_name=args.served_model_name or served_name(args.model, model)
    )
    _check_scale_flags(args)
    if args.ray:
        return _run_on_ray(args, dataclasses.replace(spec, model=os.path.abspath(model)))
    sock = bind(args.host, args.port)
    try:
        with LoadingResponder(sock):  # /health and every route answer 503 until the app serves
            app, sizes = load_app(spec, _say)
        port = sock.getsockname()[1]
        url = f"http://{f'[{args.host}]' if ':' in args.host else args.host}:{port}"
        if args.host not in LOOPBACK and api_key is None:
            _say(f"warning: {args.host} is reachable from other machines and no --api-key is set")
        _log_requests(args.log_level)
        uvicorn_level = "warning" if args.log_level == "info" else args.log_level
        server = _Uvicorn(
            uvicorn.Config(app, log_level=uvicorn_level, access_log=False, **limits.uvicorn_options()),
            f"listening on {url} (batch {sizes.max_batch}, at least {sizes.min_rows} "
            f"row{'s' if sizes.min_rows != 1 else ''} a step, {sizes.max_model_len} tokens per sequence)",
        )
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


class _Uvicorn:
    """uvicorn's server, saying ``ready`` once it accepts connections (not when it merely starts)."""

    def __init__(self, config: Any, ready: str) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                await super().startup(sockets)
                if self.started:
                    _say(ready)

        self.server = Server(config)

    def run(self, sockets: list[socket.socket]) -> None:
        self.server.run(sockets=sockets)


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--min-batch-rows must be 'auto' or an integer >= 1 (got {text!r})")
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m onnxgen.cli.serve``: the serve command alone, with the CLI's one-line user errors."""
    parser = argparse.ArgumentParser(prog="onnxgen serve", description=__doc__.splitlines()[0])
    _add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (OnnxgenError, ValueError, FileNotFoundError) as e:
        print(f"onnxgen serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
