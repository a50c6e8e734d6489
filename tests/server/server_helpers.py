"""A real ``onnxgen serve`` process on 127.0.0.1 for the server tests, and readers for its /metrics."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from onnxgen.testing import build_model, int8_activations

START_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``python -m onnxgen.cli.serve MODEL --port P --threads 1 ...``, stopped by :meth:`close`."""

    def __init__(self, model_dir: Path, log_path: Path, *flags: str) -> None:
        self.model_name = model_dir.name
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "onnxgen.cli.serve", str(model_dir), "--port", str(self.port)]
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen([*cmd, "--threads", "1", *flags], stdout=self._log, stderr=self._log)
        self._wait_ready()
        self.client = openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=60
        )
        self.http = httpx.Client(base_url=self.base_url, timeout=60)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.close()
        raise RuntimeError(f"the server did not answer /health within {START_TIMEOUT_S} s: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics by (name, sorted labels)."""
        text = self.http.get("/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


INT8_ACTIVATIONS = "genai-dense-int8act"
# server families in another KV-cache layout: name -> build_model(kv=...)
CACHE_VARIANTS = {"standard-dense-stacked": "stacked", "hybrid-mobius-static": "static"}


def int8_activation_model(root: Path) -> Path:
    """The tiny dense int4 export with MatMulNBits on int8 activations (accuracy_level 4, as the
    onnxruntime-genai builder writes int4 models): onnxruntime computes one row differently from several."""
    return int8_activations(build_model(root, "genai-dense", precision="int4"))
