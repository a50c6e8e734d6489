"""Training documents that repeat a span of code, so the small model learns to copy within a budget.

Large models learn to continue a repeated span (induction) from scale alone; a few million parameters
trained for half an hour do not (measured: without these documents, a function body quoted twice is
not copied). A small share of the training text therefore shows the pattern outright, built from the
training files only:

- a function followed by the same function again;
- a function followed by itself under a new name (``def name_v2(...)``, the body unchanged);
- a run of 4-12 consecutive lines of a file followed by the same lines;
- 4-12 lines drawn at random from the files (so only the repeat makes the second copy predictable)
  followed by the same lines.

Each document is short enough (functions of at most 600 characters) that both copies fit in one
512-token training window; a copy the window cuts off teaches nothing.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Iterable

REPEAT_SHARE = 0.10  # repeat documents, as a fraction of the training code's characters
SUFFIXES = ("_copy", "_v2", "_old", "_new", "2", "_impl", "_fast")


def repeat_documents(files: Iterable[str], budget_chars: int, seed: int) -> list[str]:
    """Seeded repeat documents from the texts in ``files`` until ``budget_chars`` is spent."""
    rng = random.Random(seed + 1)
    texts = list(files)
    functions = [f for text in texts for f in _function_sources(text)]
    rng.shuffle(functions)
    file_lines = [lines for text in texts if len(lines := text.splitlines(keepends=True)) > 40]
    out: list[str] = []
    spent = 0
    while functions and spent < budget_chars:
        kind = rng.random()
        if kind < 0.4:
            if kind < 0.2:  # consecutive lines
                lines = rng.choice(file_lines)
                start = rng.randrange(len(lines) - 12)
                region = "".join(lines[start : start + rng.randint(4, 12)])
            else:  # lines from anywhere
                region = "".join(rng.choice(rng.choice(file_lines)) for _ in range(rng.randint(4, 12)))
            doc = f"{region}\n{region}"
        else:
            name, source = functions.pop()
            second = source
            if kind < 0.7:
                suffix = rng.choice(SUFFIXES)
                second = re.sub(rf"\bdef {re.escape(name)}\(", f"def {name}{suffix}(", source, count=1)
            doc = f"{source}\n\n\n{second}\n"
        out.append(doc)
        spent += len(doc)
    return out


def _function_sources(text: str) -> list[tuple[str, str]]:
    """(name, source lines) of every function of 100-600 characters, methods included (indented)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
            source = "".join(lines[node.lineno - 1 : node.end_lineno]).rstrip()
            if 100 <= len(source) <= 600:
                found.append((node.name, source))
    return found
