"""``onnxgen bench --prefix-cache``: what the prefix cache saves, side by side with it off.

(a) *chat*: a conversation of ``turns`` user messages of ~``turn_tokens`` tokens each, rendered through the
model's chat template (``LLM.chat``), replied to by a model loaded with the prefix cache and by one without,
turn by turn (interleaved): time to first token per turn, the share of prompt tokens resumed from the
cache, and the time the cached model spends after each reply running the next turn's opening tokens into
the cache (``LLM.chat``'s ``cache_turn``; off the next turn's TTFT, part of this turn's total time). Both
replies decode the same prompt: the history holds the cached model's replies.

(b) *server*: ``clients`` concurrent streaming clients, each asking ``requests`` questions after one shared
~``system_tokens``-token system prompt, against ``onnxgen serve`` with the cache and without (one server at a
time): time to first token p50/p95, generated tokens per second, hit rate and bytes in use.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxgen.bench.prompts import NOVEL_TEXT

MB = 1 << 20


@dataclass
class PrefixBenchConfig:
    model: str
    threads: int
    cache_mb: float = 512
    turns: int = 10
    turn_tokens: int = 200
    new_tokens: int = 32
    clients: int = 8
    requests: int = 3
    system_tokens: int = 1000
    server: bool = True
    runs: int = 3  # conversations (each turn's TTFT is the median over them)


@dataclass
class PrefixBenchReport:
    model: str
    chat_ttft_plain: list[float] = field(default_factory=list)  # per turn: the median over the runs
    chat_ttft_cached: list[float] = field(default_factory=list)
    chat_prompt_tokens: list[int] = field(default_factory=list)
    chat_cached_tokens: list[int] = field(default_factory=list)
    chat_after_reply: list[float] = field(default_factory=list)  # per turn: seconds closing the turn (median)
    chat_cache_bytes: int = 0
    cache_budget: int = 0
    server: dict[str, dict[str, float]] = field(default_factory=dict)


def _words(encode: Any, tokens: int, offset: int) -> str:
    """About ``tokens`` tokens of text, starting ``offset`` words into the corpus (so turns differ)."""
    words = NOVEL_TEXT.split()
    out: list[str] = [words[offset % len(words)]]
    i = offset + 7
    while len(encode(" ".join(out))) < tokens:
        out.append(words[i % len(words)])
        i += 7  # a stride coprime with the corpus length: another word order each turn
    return " ".join(out)


def _fit(turn_tokens: int, context: int | None, turns: int, new_tokens: int) -> int:
    """Tokens per user message such that the whole conversation fits the model's context (the bundled
    model holds 1024 tokens: its turns are shorter)."""
    if context is None:
        return turn_tokens
    # a random-weight reply re-encodes to a few more tokens than were generated: longer replies keep a margin
    margin = 12 + max(0, new_tokens - 32) // 16
    return max(8, min(turn_tokens, (context - 64) // turns - new_tokens - margin))


def run_chat(cfg: PrefixBenchConfig, report: PrefixBenchReport) -> None:
    import onnxgen
    from onnxgen import SamplingParams

    plain = onnxgen.load(cfg.model, threads=cfg.threads)
    cached = onnxgen.load(cfg.model, threads=cfg.threads, prefix_cache_mb=cfg.cache_mb)
    params = SamplingParams(max_new_tokens=cfg.new_tokens, ignore_eos=True)
    encode = cached.encode
    turn_tokens = _fit(cfg.turn_tokens, cached.package.context_length, cfg.turns, cfg.new_tokens)
    plain.generate(encode("warm up"), SamplingParams(max_new_tokens=2))
    cached.generate(encode("warm up"), SamplingParams(max_new_tokens=2))
    assert cached.prefix_cache is not None
    off: list[list[float]] = [[] for _ in range(cfg.turns)]
    on: list[list[float]] = [[] for _ in range(cfg.turns)]
    after: list[list[float]] = [[] for _ in range(cfg.turns)]
    for run in range(cfg.runs):  # each run is another conversation (another system message)
        cached.prefix_cache.clear()
        chat = [{"role": "system", "content": f"You are a helpful assistant (conversation {run})."}]
        for turn in range(cfg.turns):
            chat.append({"role": "user", "content": _words(encode, turn_tokens, 31 * turn + run)})
            base = plain.chat(chat, params)  # interleaved: the two see the same load
            got = cached.chat(chat, params)
            off[turn].append(float(base.stats["ttft_s"]))
            on[turn].append(float(got.stats["ttft_s"]))
            after[turn].append(float(got.stats.get("next_turn_prefill_s", 0.0)))
            if run == 0:
                report.chat_prompt_tokens.append(int(got.stats["prompt_tokens"]))
                report.chat_cached_tokens.append(int(got.stats["cached_tokens"]))
            chat.append({"role": "assistant", "content": got.text})
        stats = cached.prefix_cache.stats()
        report.chat_cache_bytes, report.cache_budget = stats.bytes, stats.budget
    report.chat_ttft_plain = [statistics.median(t) for t in off]
    report.chat_ttft_cached = [statistics.median(t) for t in on]
    report.chat_after_reply = [statistics.median(t) for t in after]


async def _clients(
    base_url: str, model: str, system: str, questions: list[list[str]], new: int
) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    ttfts: list[float] = []
    cached: list[int] = []
    prompt: list[int] = []
    tokens = 0

    async def one(asks: list[str]) -> None:
        nonlocal tokens
        for q in asks:
            start = time.perf_counter()
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
                max_tokens=new,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            first = None
            async for chunk in stream:  # (the first chunk, the role's, comes before the prefill)
                if first is None and chunk.choices and (chunk.choices[0].model_extra or {}).get("token_ids"):
                    first = time.perf_counter() - start
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens
                    prompt.append(chunk.usage.prompt_tokens)
                    details = chunk.usage.prompt_tokens_details
                    cached.append((details.cached_tokens or 0) if details is not None else 0)
            ttfts.append(first if first is not None else time.perf_counter() - start)

    start = time.perf_counter()
    try:
        await asyncio.gather(*[one(asks) for asks in questions])
    finally:
        await client.close()
    wall = time.perf_counter() - start
    return {
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p95_s": float(np.percentile(ttfts, 95)),
        "tok_s": tokens / wall,
        "wall_s": wall,
        "hit_rate": sum(cached) / sum(prompt) if prompt else 0.0,
    }


def run_server(cfg: PrefixBenchConfig, report: PrefixBenchReport) -> None:
    import httpx

    import onnxgen
    from onnxgen.cli.serve import bind

    llm = onnxgen.load(cfg.model, threads=1)
    encode = llm.encode
    context = llm.package.context_length
    system = _words(encode, min(cfg.system_tokens, context - 128) if context else cfg.system_tokens, 0)
    questions = [
        [f"Question {c}.{r}: " + _words(encode, 30, 97 * c + 13 * r + 5) for r in range(cfg.requests)]
        for c in range(cfg.clients)
    ]
    for label, mb in (("off", 0.0), ("on", cfg.cache_mb)):
        sock = bind("127.0.0.1", 0)
        port = sock.getsockname()[1]
        sock.close()
        cmd = [sys.executable, "-m", "onnxgen.cli.serve", cfg.model, "--port", str(port)]
        cmd += ["--threads", str(cfg.threads), "--prefix-cache-mb", str(mb), "--max-batch", str(cfg.clients)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            name = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
            result = asyncio.run(_clients(base, name, system, questions, cfg.new_tokens))
            if mb:
                text = httpx.get(f"{base}/metrics").text
                for line in text.splitlines():
                    if line.startswith("onnxgen_prefix_cache_bytes "):
                        result["cache_bytes"] = float(line.split()[1])
            report.server[label] = result
        finally:
            proc.terminate()
            proc.wait(30)


def run_prefix_bench(cfg: PrefixBenchConfig) -> PrefixBenchReport:
    report = PrefixBenchReport(cfg.model)
    run_chat(cfg, report)
    if cfg.server:
        run_server(cfg, report)
    return report


def format_prefix_report(r: PrefixBenchReport) -> str:
    lines = [
        f"prefix cache: {r.model}",
        "chat turn | prompt tokens | cached | TTFT off (ms) | TTFT on (ms) | on/off | after reply (ms)",
    ]
    after = r.chat_after_reply or [0.0] * len(r.chat_prompt_tokens)
    for i, (p, c, a, b, x) in enumerate(
        zip(
            r.chat_prompt_tokens,
            r.chat_cached_tokens,
            r.chat_ttft_plain,
            r.chat_ttft_cached,
            after,
            strict=True,
        )
    ):
        lines.append(
            f"{i + 1:9d} | {p:13d} | {c:6d} | {a * 1e3:13.1f} | {b * 1e3:12.1f} | {b / a:6.3f} | {x * 1e3:16.1f}"
        )
    total = sum(r.chat_prompt_tokens)
    rate = sum(r.chat_cached_tokens) / total if total else 0.0
    lines.append(
        f"chat hit rate {rate:.1%} of prompt tokens; cache holds {r.chat_cache_bytes / MB:.1f} MiB "
        f"of {r.cache_budget / MB:.0f} MiB"
    )
    for label, s in r.server.items():
        extra = f", cache {s['cache_bytes'] / MB:.1f} MiB" if "cache_bytes" in s else ""
        lines.append(
            f"server cache {label}: TTFT p50 {s['ttft_p50_s'] * 1e3:.0f} ms, p95 {s['ttft_p95_s'] * 1e3:.0f} ms, "
            f"{s['tok_s']:.1f} tok/s, hit rate {s['hit_rate']:.1%}{extra}"
        )
    if r.chat_ttft_plain:
        lines.append(f"median chat TTFT ratio on/off: {statistics.median(_ratios(r)):.3f}")
    return "\n".join(lines)


def _ratios(r: PrefixBenchReport) -> list[float]:
    return [b / a for a, b in zip(r.chat_ttft_plain, r.chat_ttft_cached, strict=True)]
