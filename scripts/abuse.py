"""Replay the bad-request catalogue against a live ``onnxgen serve`` and check that it takes no harm.

    python scripts/abuse.py [MODEL] [--rounds 3] [--rss-growth-mb 512]

Starts ``onnxgen serve`` on MODEL (default: a tiny random dense model built in a temporary folder) on a
free loopback port, asks one greedy completion, then sends every request of
``onnxgen.testing.abuse.catalogue`` ``--rounds`` times one after another and once all at the same time,
plus requests at the documented limits (16 stop strings of 512 characters on 4 prompts x 4 choices).
It checks that every bad request gets its 4xx, the limit requests a 200, the server's resident memory
(VmRSS, sampled after each request, and the kernel's peak VmHWM at the end) stays within
``--rss-growth-mb`` of what it was after the first request, /metrics counted no 5xx, and the same greedy
completion afterwards gives the same text. Prints one line per check; exit code 1 when any fails.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from onnxgen.testing import TinySpec, build_model
from onnxgen.testing.abuse import Abuse, catalogue

MAX_BATCH, MAX_QUEUE = 4, 4


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
    cmd += ["--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE)]
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
        requests = catalogue(model.name, MAX_BATCH, MAX_QUEUE) + limit_requests(model.name)
        peak, start_time = base, time.perf_counter()
        for round_ in range(args.rounds):
            for abuse in requests:
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
        with ThreadPoolExecutor(len(requests)) as pool:  # all at once
            together = list(pool.map(lambda a: send(url, a), requests))
        peak = max(peak, rss_mb(proc.pid))
        wrong = [f"{a.name}: {s}" for a, s, _ in together if s != a.status]
        check(not wrong, f"all {len(requests)} at once: each got its status {wrong or ''}")
        hwm = rss_mb(proc.pid, "VmHWM")
        print(
            f"{args.rounds} rounds + 1 concurrent of {len(requests)} requests in {time.perf_counter() - start_time:.1f} s"
        )
        check(
            max(peak, hwm) - base < args.rss_growth_mb,
            f"RSS: {base:.0f} MB after the first request, {peak:.0f} MB at most when sampled, peak (VmHWM) "
            f"{hwm:.0f} MB: growth {max(peak, hwm) - base:.0f} MB < {args.rss_growth_mb:.0f} MB",
        )
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        fives = [line for line in metrics.splitlines() if 'status="5' in line and not line.endswith(" 0.0")]
        check(not fives, f"/metrics counted no 5xx {fives or ''}")
        after = httpx.post(f"{url}/v1/completions", json=greedy, timeout=120).json()["choices"][0]["text"]
        check(after == before, f"the same greedy completion before and after: {after!r}")
    finally:
        proc.terminate()
        proc.wait(10)
    print("all checks passed" if not failures else f"{failures} checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
