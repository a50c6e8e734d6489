"""Replay the bad-request catalogue against a live ``onnxgen serve`` and check that it takes no harm.

    python scripts/abuse.py [MODEL] [--rounds 3] [--rss-growth-mb 512]

Starts ``onnxgen serve`` on MODEL (default: a tiny random dense model built in a temporary folder) on a
free loopback port, with a prefix cache and a 2 s header deadline, asks one greedy completion, then
sends every request of ``onnxgen.testing.abuse.catalogue`` ``--rounds`` times one after another and
once all at the same time, plus requests at the documented limits (16 stop strings of 512 characters on
4 prompts x 4 choices). Then the connection-level cases: eight bodies trickled a byte at a time (each
408 within seconds, a normal request beside them answered at once), idle and header-dripping
connections (closed by the server), a streamed answer its client does not read (ended), and a client
probing another's prompt through ``cached_tokens`` under another ``cache_salt`` (a right and a wrong
guess look alike). /health is timed every 50 ms throughout. It checks that every bad request gets its
4xx, the limit requests a 200, /health answers within 100 ms, the server's resident memory (VmRSS,
sampled after each request, and the kernel's peak VmHWM at the end) stays within ``--rss-growth-mb`` of
what it was after the first request, /metrics counted no 5xx, the same greedy completion afterwards
gives the same text, and SIGTERM ends the server within its ``--shutdown-timeout`` while a stream is
held unread. Prints one line per check; exit code 1 when any fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from onnxgen.testing import TinySpec, build_model
from onnxgen.testing.abuse import Abuse, catalogue, trickle, unread_stream

MAX_BATCH, MAX_QUEUE = 4, 4
SHUTDOWN_S = 3
Check = Callable[[bool, str], None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def start(model: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "onnxgen.cli.serve", str(model), "--port", str(port), "--threads", "1"]
    cmd += ["--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE), "--prefix-cache-mb", "64"]
    cmd += ["--header-timeout", "2", "--shutdown-timeout", str(SHUTDOWN_S)]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start within 120 s")


def limit_requests(model: str) -> list[Abuse]:
    """Requests at the documented limits: they must be served (200), not refused, and cost little."""
    stops = {"stop": [f"{i:02d}" + "x" * 510 for i in range(16)], "max_tokens": 16}
    prompts = {"model": model, "prompt": ["def f():"] * MAX_QUEUE, "n": MAX_BATCH, **stops}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "n": MAX_BATCH, **stops}
    return [
        Abuse(
            "16 stops of 512 characters, 4 prompts x 4 choices",
            "/v1/completions",
            json.dumps(prompts).encode(),
            200,
            "",
        ),
        Abuse(
            "16 stops of 512 characters, chat, 4 choices",
            "/v1/chat/completions",
            json.dumps(chat).encode(),
            200,
            "",
        ),
    ]


def send(url: str, abuse: Abuse) -> tuple[Abuse, int, str]:
    with httpx.Client(base_url=url, timeout=120) as client:
        r = client.request(abuse.method, abuse.path, content=abuse.body, headers=abuse.headers)
        message = r.json().get("error", {}).get("message", "") if r.status_code != 200 else ""
        return abuse, r.status_code, message


_HEALTH_LOOP = """
import sys, time, httpx
with httpx.Client(base_url=sys.argv[1], timeout=10) as client:
    while True:
        start = time.monotonic()
        try:
            ok = client.get("/health").status_code == 200
        except httpx.HTTPError:
            ok = False
        print(start, time.monotonic() - start, int(ok), flush=True)
        time.sleep(0.05)
"""


class HealthWatch:
    """/health timed every 50 ms by a process of its own (so this script's own work does not delay the
    timing) while the checks run; ``phase`` names what runs, for the report."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HEALTH_LOOP, url], stdout=subprocess.PIPE, text=True
        )
        self.phases: list[tuple[float, str]] = [(time.monotonic(), "start")]
        self.worst: dict[str, float] = {}
        self.failed = 0

    @property
    def phase(self) -> str:
        return self.phases[-1][1]

    @phase.setter
    def phase(self, name: str) -> None:
        self.phases.append((time.monotonic(), name))

    def stop(self) -> None:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        for line in out.splitlines():
            at, took, ok = line.split()
            phase = next((name for t, name in reversed(self.phases) if t <= float(at)), "start")
            self.worst[phase] = max(self.worst.get(phase, 0.0), float(took))
            self.failed += ok == "0"


def connection_cases(url: str, port: int, check: Check, health: HealthWatch) -> None:
    """Slow bodies, idle and header-dripping connections, and a stream left unread."""
    health.phase = "trickled bodies"
    with ThreadPoolExecutor(8) as pool:
        slow = [pool.submit(trickle, port, seconds=15.0) for _ in range(8)]
        time.sleep(0.5)
        start = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
        fast = time.perf_counter() - start
        statuses = [f.result() for f in slow]
    check(
        r.status_code == 200 and fast < 2,
        f"a request beside 8 trickled bodies: {r.status_code} in {fast:.2f} s",
    )
    check(statuses == [408] * 8, f"8 bodies trickled a byte at a time: {statuses}")
    health.phase = "idle connections"
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    for sock in socks[:5]:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Drip: a")
    deadline, open_ = time.monotonic() + 8, set(range(len(socks)))
    while open_ and time.monotonic() < deadline:
        for i in list(open_):
            socks[i].settimeout(0.05)
            try:
                if i < 5:
                    socks[i].sendall(b"a")
                if socks[i].recv(64) == b"":
                    open_.discard(i)
            except TimeoutError:
                pass
            except OSError:
                open_.discard(i)
        time.sleep(0.2)
    for sock in socks:
        sock.close()
    check(not open_, f"15 idle and 5 header-dripping connections closed by the server ({len(open_)} open)")
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1900,
        "n": MAX_BATCH,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": True,
        "ignore_eos": True,
    }
    health.phase = "a stream left unread"
    received = unread_stream(port, "/v1/chat/completions", body, 8.0)
    check(
        b"the client read none" in received, f"a stream left unread for 8 s is ended ({len(received)} bytes)"
    )


def cache_probe(url: str, check: Check) -> None:
    """Another ``cache_salt`` learns nothing from ``cached_tokens``; the owner's own salt does."""
    secret = [int(t) for t in range(40, 72)]
    known, wrong = 16, 200

    def cached(prompt: list[int], **extra: str) -> int:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    cached(secret, cache_salt="owner")
    # each probe in a salt of its own (a prober's own probes would be found by its next ones)
    right = cached([*secret[:known], secret[known], 3], cache_salt="prober-1")
    missed = cached([*secret[:known], wrong, 3], cache_salt="prober-2")
    unsalted = cached([*secret[:known], secret[known], 3])
    owner = cached([*secret[:known], secret[known], 3], cache_salt="owner")
    check(
        right == missed == unsalted == 0 and owner == known + 1,
        f"cache probe from other salts: right guess {right}, wrong {missed}, unsalted {unsalted} cached "
        f"tokens; the owner's salt resumes {owner}",
    )


def shutdown_with_unread_stream(proc: subprocess.Popen[bytes], port: int, check: Check) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1900, "n": MAX_BATCH}
    body.update(logprobs=True, top_logprobs=20, stream=True, ignore_eos=True)
    holder = threading.Thread(
        target=unread_stream, args=(port, "/v1/chat/completions", body, 60.0), daemon=True
    )
    holder.start()
    time.sleep(2)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(SHUTDOWN_S + 10)
    took = time.monotonic() - start
    check(proc.poll() is not None, f"SIGTERM with a stream held unread: exited in {took:.1f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="model directory (default: a tiny random dense model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rss-growth-mb", type=float, default=512.0)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="onnxgen-abuse-"))
    model = (
        Path(args.model)
        if args.model
        else build_model(tmp / "tiny", "genai-dense", TinySpec(max_position=2048))
    )
    proc, url = start(model, tmp / "server.log")
    failures = 0

    def check(ok: bool, what: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)

    try:
        greedy = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}
        before = httpx.post(f"{url}/v1/completions", json=greedy, timeout=120).json()["choices"][0]["text"]
        base = rss_mb(proc.pid)
        print(f"server pid {proc.pid} on {url}, model {model}; RSS after one request {base:.0f} MB")
        health = HealthWatch(url)
        requests = catalogue(model.name, MAX_BATCH, MAX_QUEUE) + limit_requests(model.name)
        peak, start_time = base, time.perf_counter()
        for round_ in range(args.rounds):
            for abuse in requests:
                health.phase = abuse.name if round_ == 0 else "one at a time"
                t = time.perf_counter()
                _, status, message = send(url, abuse)
                peak = max(peak, rss_mb(proc.pid))
                if round_ == 0:
                    check(
                        status == abuse.status and abuse.says in message,
                        f"{abuse.name}: {status} in {1000 * (time.perf_counter() - t):.0f} ms"
                        + (f" ({message[:110]})" if message else ""),
                    )
                elif status != abuse.status:
                    check(False, f"round {round_ + 1}: {abuse.name}: {status}")
        health.phase = "all at once"
        with ThreadPoolExecutor(len(requests)) as pool:  # all at once
            together = list(pool.map(lambda a: send(url, a), requests))
        peak = max(peak, rss_mb(proc.pid))
        # (a request that would be served may find the queue full then: 503, as documented)
        wrong = [f"{a.name}: {s}" for a, s, _ in together if s != a.status and (a.status, s) != (200, 503)]
        full = sum((a.status, s) == (200, 503) for a, s, _ in together)
        check(
            not wrong, f"all {len(requests)} at once: each got its status {wrong or ''} ({full} queue full)"
        )
        hwm = rss_mb(proc.pid, "VmHWM")
        print(
            f"{args.rounds} rounds + 1 concurrent of {len(requests)} requests in {time.perf_counter() - start_time:.1f} s"
        )
        check(
            max(peak, hwm) - base < args.rss_growth_mb,
            f"RSS: {base:.0f} MB after the first request, {peak:.0f} MB at most when sampled, peak (VmHWM) "
            f"{hwm:.0f} MB: growth {max(peak, hwm) - base:.0f} MB < {args.rss_growth_mb:.0f} MB",
        )
        connection_cases(url, int(url.rsplit(":", 1)[1]), check, health)
        health.phase = "cache probe"
        cache_probe(url, check)
        peak = max(peak, rss_mb(proc.pid))
        health.stop()
        slow = sorted(health.worst.items(), key=lambda item: -item[1])[:4]
        worst = ", ".join(f"{phase}: {1000 * s:.0f} ms" for phase, s in slow)
        check(
            max(health.worst.values()) < 0.1 and not health.failed,
            f"/health every 50 ms throughout, slowest during {worst}; {health.failed} failed",
        )
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        fives = [
            line
            for line in metrics.splitlines()
            if line.startswith("onnxgen_requests_total")
            and 'status="5' in line
            and 'status="503"' not in line  # queue full, above
            and not line.endswith(" 0.0")
        ]
        check(not fives, f"/metrics counted no 5xx but queue-full 503s {fives or ''}")
        after = httpx.post(f"{url}/v1/completions", json=greedy, timeout=120).json()["choices"][0]["text"]
        check(after == before, f"the same greedy completion before and after: {after!r}")
        shutdown_with_unread_stream(proc, int(url.rsplit(":", 1)[1]), check)
    finally:
        proc.terminate()
        proc.wait(10)
    print("all checks passed" if not failures else f"{failures} checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
