"""The engines ``onnxgen bench --workload`` drives, each as its user would, timed per token on the client.

- :class:`OnnxgenServer`: ``onnxgen serve MODEL`` on 127.0.0.1 with its defaults (plus any flags given),
  streamed over HTTP (``/v1/chat/completions``, ``return_token_ids`` so each token is seen as it arrives);
- :class:`GenaiChat`: onnxruntime-genai's Python API with its defaults (one ``og.Generator`` per request;
  the chat template applied by ``og.Tokenizer.apply_chat_template``);
- :class:`LlamaCppChat`: llama-cpp-python's ``Llama`` with its defaults: one context kept between
  requests, whose ``generate`` evaluates only what follows the longest prefix it already holds.

Every engine gets the same thread count and decodes greedily up to ``max_tokens`` tokens, stopping early
at the model's end-of-sequence token (counted as generated, as servers count it in ``usage``).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from onnxgen.bench.genai_engine import GENAI, BenchError, threads_overlay

ONNXGEN = "onnxgen"
LLAMA_CPP = "llama.cpp"
ENGINES = (ONNXGEN, GENAI, LLAMA_CPP)
LLAMA_CTX = 8192  # llama-cpp-python's own default (512) holds none of the workloads
START_TIMEOUT_S = 600.0


@dataclass
class Sample:
    """One request as the client saw it. ``stamps_s``: when each generated token arrived, from the
    request's start; ``usage_tokens`` / ``cached_tokens``: what the server reported (None elsewhere)."""

    prompt_tokens: int
    stamps_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    text: str = ""
    usage_tokens: int | None = None
    cached_tokens: int | None = None


class Engine(Protocol):
    name: str

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> Sample: ...

    def close(self) -> None: ...


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_label(flags: tuple[str, ...]) -> str:
    """The engine name of an onnxgen server started with ``flags``: ``onnxgen`` for the defaults."""
    return " ".join((ONNXGEN, *flags))


class OnnxgenServer:
    """``python -m onnxgen.cli.serve MODEL --port P --threads T *flags``, stopped by :meth:`close`."""

    name = ONNXGEN

    def __init__(self, model: str, threads: int, flags: tuple[str, ...] = ()) -> None:
        self.name = server_label(flags)
        try:
            import httpx
        except ImportError as e:
            raise BenchError("the workload benchmark needs httpx: pip install 'onnxgen[bench]'") from e
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "onnxgen.cli.serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        cmd += ["--threads", str(threads), *flags]
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (the server's log, closed by close())
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=self._log)
        self.http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(600.0, connect=10.0))
        self._wait_ready(httpx)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]

    def _wait_ready(self, httpx: Any) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log()
                self.close()
                raise BenchError(f"onnxgen serve exited with {self.proc.returncode}:\n{log}")
            try:
                if self.http.get("/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        log = self.log()
        self.close()
        raise BenchError(f"onnxgen serve did not answer /health within {START_TIMEOUT_S:.0f} s:\n{log}")

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def said(self) -> list[str]:
        """What the server said at start, up to ``listening on ...`` (its settings; no request lines)."""
        self._log.seek(0)
        said = []
        for line in self._log.read().decode(errors="replace").splitlines():
            if line.startswith("onnxgen serve: "):
                said.append(line.removeprefix("onnxgen serve: "))
                if said[-1].startswith("listening on"):
                    break
        return said

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> Sample:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        sample = Sample(prompt_tokens=0)
        text: list[str] = []
        start = time.perf_counter()
        with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                answer = response.read().decode()
                hint = (
                    ' (a longer context: --server-flags "--max-model-len N")' if "context" in answer else ""
                )
                raise BenchError(f"onnxgen serve answered {response.status_code}: {answer}{hint}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter() - start
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", ()):
                    sample.stamps_s += [now] * len(choice.get("token_ids") or ())
                    text.append((choice.get("delta") or {}).get("content") or "")
                if chunk.get("usage"):
                    use = chunk["usage"]
                    sample.prompt_tokens, sample.usage_tokens = use["prompt_tokens"], use["completion_tokens"]
                    sample.cached_tokens = (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        sample.total_s = time.perf_counter() - start
        sample.text = "".join(text)
        return sample

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class GenaiChat:
    """onnxruntime-genai on the CPU provider, its defaults but for the thread count."""

    name = GENAI

    def __init__(self, model_dir: str, threads: int) -> None:
        import onnxruntime_genai as og

        self._og = og
        config = og.Config(model_dir)
        config.clear_providers()
        config.overlay(threads_overlay(threads))
        self.model = og.Model(config)
        self.tokenizer = og.Tokenizer(self.model)
        template = Path(model_dir) / "chat_template.jinja"
        self.template = template.read_text() if template.is_file() else None

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> Sample:
        import numpy as np

        og = self._og
        start = time.perf_counter()
        prompt = self.tokenizer.apply_chat_template(
            json.dumps(messages), template_str=self.template, add_generation_prompt=True
        )
        ids = np.asarray(self.tokenizer.encode(prompt), dtype=np.int32)
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(ids) + max_tokens)
        generator = og.Generator(self.model, params)
        generator.append_tokens(ids)
        stream = self.tokenizer.create_stream()
        sample = Sample(prompt_tokens=len(ids), cached_tokens=0)  # a new generator holds nothing
        text: list[str] = []
        while not generator.is_done():
            generator.generate_next_token()
            token = int(generator.get_next_tokens()[0])
            sample.stamps_s.append(time.perf_counter() - start)
            text.append(stream.decode(token))
        sample.total_s = time.perf_counter() - start
        sample.text = "".join(text)
        return sample

    def close(self) -> None:
        del self.model


class LlamaCppChat:
    """llama-cpp-python's ``Llama`` on a GGUF file, with the chat template the file carries."""

    name = LLAMA_CPP

    def __init__(self, gguf: str, threads: int) -> None:
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self._lc = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=LLAMA_CTX, verbose=False
        )
        template = self.llm.metadata.get("tokenizer.chat_template")
        if not template:
            raise BenchError(f"{gguf} carries no chat template (tokenizer.chat_template)")
        self.format = Jinja2ChatFormatter(
            template,
            eos_token=self._token_text(self.llm.token_eos()),
            bos_token=self._token_text(self.llm.token_bos()),
            add_generation_prompt=True,
        )
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.held: list[int] = []  # the tokens the context holds (evaluated) after the last request

    def _token_text(self, token: int) -> str:
        return self.llm.detokenize([token], special=True).decode(errors="replace") if token >= 0 else ""

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> Sample:
        start = time.perf_counter()
        rendered = self.format(messages=messages)
        ids = self.llm.tokenize(rendered.prompt.encode(), add_bos=not rendered.added_special, special=True)
        # generate() evaluates only what follows the longest prefix the context holds (at least one token)
        reused = next((i for i, (a, b) in enumerate(zip(self.held, ids, strict=False)) if a != b), None)
        reused = min(len(ids) - 1, min(len(self.held), len(ids)) if reused is None else reused)
        sample = Sample(prompt_tokens=len(ids), cached_tokens=reused)
        out: list[int] = []
        for token in self.llm.generate(ids, temp=0.0):
            sample.stamps_s.append(time.perf_counter() - start)
            out.append(token)  # (the last one yielded is never evaluated)
            if self._lc.llama_vocab_is_eog(self.vocab, token) or len(out) >= max_tokens:
                break
        sample.total_s = time.perf_counter() - start
        self.held = list(ids) + out[:-1]
        eog = out and self._lc.llama_vocab_is_eog(self.vocab, out[-1])
        sample.text = self.llm.detokenize(out[:-1] if eog else out).decode(errors="replace")
        return sample

    def close(self) -> None:
        self.llm.close()
