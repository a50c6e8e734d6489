"""OpenAI's structured-output reading of a JSON schema's objects: no properties beyond those listed.

JSON Schema lets an object hold keys its ``properties`` do not list unless it says
``"additionalProperties": false``; Pydantic, instructor and LangChain send schemas that say nothing, and
a model constrained by the letter of such a schema may go on adding keys until its token limit. OpenAI's
structured outputs read them closed, and so does onnxgen by default (``SamplingParams.json_extra_properties``
turns the permissive reading back on):

1. An object schema that lists ``properties`` and says nothing of ``additionalProperties``,
   ``patternProperties`` or ``unevaluatedProperties`` gets ``"additionalProperties": false``.
2. An object schema without ``properties`` (``{"type": "object"}``, what ``json_object`` asks for) stays
   open: it lists nothing to hold the keys to.
3. The parts of an ``allOf`` stay as they are (closing each would forbid the keys of the others); the
   schemas below them are read by these rules.
4. Subschemas are found by keyword (``properties``, ``items``, ``anyOf``, ``$defs``, ...), never by
   shape, so a property that happens to be named ``properties`` is no schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_SCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def close_objects(schema: Any, close: bool = True) -> Any:
    """``schema`` with every object that lists its properties closed to them (rules in the module
    docstring); the input is not modified. ``close=False`` (an ``allOf`` part) leaves this level open."""
    if isinstance(schema, list):  # items as a list (draft 4 tuples)
        return [close_objects(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema  # true / false schemas, and anything malformed (the compiler names it)
    out = dict(schema)
    for key in _SCHEMA:
        if key in out and isinstance(out[key], (Mapping, list)):
            out[key] = close_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [close_objects(s, close=False) for s in out["allOf"]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    if close and isinstance(out.get("properties"), Mapping) and not any(k in out for k in _OPENERS):
        out["additionalProperties"] = False
    return out
