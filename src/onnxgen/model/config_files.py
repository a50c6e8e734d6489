"""Reading the config files beside model.onnx: JSON and YAML, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from onnxgen.errors import ConfigError, ModelPackageError

# inference_metadata may be YAML or JSON; the first one found wins (and a second one is noted).
INFERENCE_METADATA_NAMES = ("inference_metadata.yaml", "inference_metadata.yml", "inference_metadata.json")
JSON_CONFIG_NAMES = {
    "genai_config": "genai_config.json",
    "hf_config": "config.json",
    "generation_config": "generation_config.json",
    "tokenizer_config": "tokenizer_config.json",
}
TOKENIZER_NAME = "tokenizer.json"
CHAT_TEMPLATE_NAME = "chat_template.jinja"


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text ({e}); re-save it as UTF-8 JSON/YAML") from e
    except OSError as e:
        raise ModelPackageError(f"cannot read {path}: {e.strerror or e}") from e


def read_config(path: Path) -> dict[str, Any]:
    """Parse one JSON or YAML config file (by suffix) into a mapping.

    Raises :class:`ConfigError` naming the file and the parser's message when it is malformed or
    its top level is not a mapping.
    """
    text = _read_text(path)
    if path.suffix in (".yaml", ".yml"):
        import yaml  # only for YAML files (most packages have none; a load does not pay for the import)

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            detail = " ".join(str(e).split())
            raise ConfigError(f"{path} is not valid YAML: {detail}; fix or remove the file") from e
        if data is None:
            data = {}
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}; fix or remove the file"
            ) from e
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path} must hold a mapping at its top level, not {type(data).__name__}; fix or remove the file"
        )
    return data


def section(data: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    """``data[key]`` as a mapping (``{}`` when absent); anything else is a :class:`ConfigError`."""
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: '{key}' must be a mapping, not {type(value).__name__}")
    return value
