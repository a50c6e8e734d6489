"""On/off switches read from the environment: ``ONNXGEN_FUSE``, ``ONNXGEN_FAST_OPS``, ``ONNXGEN_HUGE_PAGES``,
``ONNXGEN_CACHE``.

Each takes ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case, surrounding spaces
ignored); unset or empty leaves the decision to onnxgen's default. Any other value is refused with a
:class:`~onnxgen.errors.SettingError` naming the variable, so a typo never silently keeps the default.
A keyword given to :func:`onnxgen.load` overrides the environment.
"""

from __future__ import annotations

import os

from onnxgen.errors import SettingError

FUSE = "ONNXGEN_FUSE"  # onnxgen.graph.decode_fusions
FAST_OPS = "ONNXGEN_FAST_OPS"  # onnxgen.graph.hybrid_ops
HUGE_PAGES = "ONNXGEN_HUGE_PAGES"  # onnxgen.runtime.hugepages
CACHE = "ONNXGEN_CACHE"  # onnxgen.runtime.graph_cache: off keeps nothing on disk past the process
SWITCHES = (FUSE, FAST_OPS, HUGE_PAGES, CACHE)
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def env_switch(name: str) -> bool | None:
    """``name``'s value as a switch: True, False, or None where it is unset or empty."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value in ON:
        return True
    if value in OFF:
        return False
    raise SettingError(
        f"{name}={raw!r} is not an on/off value; set it to one of {', '.join(ON)} (on) or "
        f"{', '.join(OFF)} (off), or unset it for onnxgen's default"
    )


def check_switches() -> None:
    """Refuse a session whose environment sets any of onnxgen's switches to something else than on/off,
    whether or not the model at hand would read it (a hybrid-only switch on a dense model, say)."""
    for name in SWITCHES:
        env_switch(name)
