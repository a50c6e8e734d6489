"""The demo model's training text: the Python standard library's own source, found offline.

Every file under ``sysconfig.get_paths()["stdlib"]`` ending in ``.py`` (the PSF-licensed library that
ships with the interpreter) is a document, except the test suites, third-party ``site-packages``,
generated codec tables (``encodings/``) and the 750 kB string of ``pydoc_data/topics.py``. About 2% of
the files, picked by a hash of their relative path, are held out for validation.

Beside the code, short ChatML conversations are made from the training files' docstrings (so the chat
template's turn markers and ``<|im_end|>`` are learned): "What does ``json.dumps`` do?" answered with
the docstring's first paragraph, and "Write ``name(args)``..." answered with the function's source.
A few documents repeat a span of the training code (:mod:`tools.demo_model.repeats`) to teach copying.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tools.demo_model.repeats import REPEAT_SHARE, repeat_documents

EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data"})
VALIDATION_PERCENT = 2
CHAT_SHARE = 0.10  # chat text, as a fraction of the training code's characters
SYSTEM_PROMPT = "You are a helpful assistant who knows the Python standard library."

_ASK = ("What does `{q}` do?", "What is {q} in the {m} module for?", "Explain {q} from {m}.")
_WRITE = ("Write `{name}({args})` from the {m} module.", "Show me how {m} implements {name}.")


@dataclass
class Corpus:
    """Documents (one string each) for training and validation, plus where they came from."""

    root: Path
    train: list[str] = field(default_factory=list)
    val: list[str] = field(default_factory=list)
    chat: list[str] = field(default_factory=list)
    repeats: list[str] = field(default_factory=list)
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)

    def digest(self) -> str:
        """sha256 over every document in order: equal digests mean equal training text."""
        h = hashlib.sha256()
        for doc in (*self.train, "\0", *self.val, "\0", *self.chat, "\0", *self.repeats):
            h.update(doc.encode("utf-8", "surrogatepass"))
            h.update(b"\0")
        return h.hexdigest()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path, without tests and tables."""
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or rel.parts[0].startswith("config-"):
            continue
        found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def is_validation(rel: str) -> bool:
    """Whether a file (path relative to the stdlib root, posix) is held out."""
    return hashlib.sha256(rel.encode()).digest()[0] * 100 < VALIDATION_PERCENT * 256


def build_corpus(root: Path | None = None, seed: int = 0) -> Corpus:
    """Read the files, make the chat conversations and the repeat documents (:mod:`.repeats`);
    deterministic for a given standard library and seed."""
    root = root or stdlib_root()
    corpus = Corpus(root=root)
    for path in source_files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        if is_validation(rel):
            corpus.val.append(text)
            corpus.val_files.append(rel)
        else:
            corpus.train.append(text)
            corpus.train_files.append(rel)
    code_chars = sum(map(len, corpus.train))
    pairs = zip(corpus.train_files, corpus.train, strict=True)
    corpus.chat = chat_conversations(pairs, int(CHAT_SHARE * code_chars), seed)
    corpus.repeats = repeat_documents(corpus.train, int(REPEAT_SHARE * code_chars), seed)
    return corpus


def chatml(turns: list[tuple[str, str]]) -> str:
    """Render (role, content) turns exactly as the chat template does."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)


def chat_conversations(files: Iterator[tuple[str, str]], budget_chars: int, seed: int) -> list[str]:
    """Seeded conversations of one or two question/answer pairs, until ``budget_chars`` is spent."""
    rng = random.Random(seed)
    pairs = [pair for rel, text in files for pair in _qa_pairs(rel, text, rng)]
    rng.shuffle(pairs)
    out: list[str] = []
    spent = 0
    while pairs and spent < budget_chars:
        turns: list[tuple[str, str]] = [("system", SYSTEM_PROMPT)] if rng.random() < 0.3 else []
        for _ in range(2 if rng.random() < 0.25 and len(pairs) > 1 else 1):
            question, answer = pairs.pop()
            turns += [("user", question), ("assistant", answer)]
        out.append(chatml(turns))
        spent += len(out[-1])
    return out


def _module_name(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _qa_pairs(rel: str, text: str, rng: random.Random) -> list[tuple[str, str]]:
    try:
        tree = ast.parse(text)
    except SyntaxError:  # lib2to3 fixtures and the like
        return []
    module = _module_name(rel)
    lines = text.splitlines(keepends=True)
    pairs = []
    for node, qual in _documented(tree):
        summary = _first_paragraph(ast.get_docstring(node) or "")
        if summary:
            ask = rng.choice(_ASK).format(q=f"{module}.{qual}", m=module)
            pairs.append((ask, summary))
        if not isinstance(node, ast.FunctionDef) or "." in qual:
            continue
        source = "".join(lines[node.lineno - 1 : node.end_lineno]).rstrip()
        if len(source) <= 1200:
            ask = rng.choice(_WRITE).format(name=qual, args=ast.unparse(node.args), m=module)
            pairs.append((ask, f"```python\n{source}\n```"))
    return pairs


def _documented(tree: ast.Module) -> Iterator[tuple[ast.AST, str]]:
    """Public functions and classes at module level, and public methods one class deep."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            yield node, node.name
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                        yield item, f"{node.name}.{item.name}"


def _first_paragraph(doc: str, limit: int = 400) -> str:
    para = inspect.cleandoc(doc).split("\n\n")[0]
    para = " ".join(para.split())
    if len(para) > limit:
        cut = para.rfind(". ", 0, limit)
        para = para[: cut + 1] if cut > 40 else ""
    return para
