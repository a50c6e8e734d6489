"""Session graphs: the export after onnxgen's graph passes, prepared once and kept on disk.

A :class:`~onnxgen.runtime.session.DecoderSession` does not hand onnxruntime the export as it is but the
graph :func:`session_graph` prepared for it (:func:`onnxgen.prepare.prepare` for a whole model): it may
output the final hidden state (:mod:`onnxgen.graph.hidden_state`, for an MTP head), adds a
logits-to-keep input (:mod:`onnxgen.graph.logits_to_keep`), may move hybrid ops onto vectorized kernels
(:mod:`onnxgen.graph.hybrid_ops`), merges projections that read one input
(:mod:`onnxgen.graph.decode_fusions`, which makes new, merged weights) and, for an MTP head that drafts,
runs its lm_head as int4 (:mod:`onnxgen.graph.int4_lm_head`). :func:`prepare_session_graph` runs
those passes once per model and settings and writes the result to ``cache_root()/graphs/<key>/``:

- ``graph.onnx``: the rewritten graph, every weight held by reference (no weight is copied into it);
- ``weights.bin``: the weights the passes made, and inline weights of the export over ``INLINE_LIMIT``
  bytes, each at a page-aligned offset so that onnxruntime maps them instead of copying;
- ``prepared.json``: what the passes and the graph analyses found (:class:`SessionGraph`).

A later load with the same key reads ``prepared.json`` and hands onnxruntime the graph: no pass runs and no
weight passes through Python. The key covers the model file (its bytes, or size and time when large), its
data files (size and time), its folder, the pass settings, the decoder's derived I/O and onnxgen's and
onnxruntime's versions: a changed model or setting misses and is prepared anew.

An entry is written whole or not at all: into a ``.build-<pid>-*`` folder, every file synced, then renamed
into place. A later load checks it before use (``prepared.json`` complete, ``graph.onnx`` the bytes it
was written with, ``weights.bin`` at its size) and prepares it again where it is damaged, so a disk
that lost a write, a truncated file or a user's edit never stops a model from loading; the build
folders of a start that was killed are removed by the next one.

onnxruntime resolves external data against one folder and refuses a location that leaves it (or is
absolute). The cached graph refers both to the export's data files and to ``weights.bin``, so its locations
are written relative to the closest folder that holds the model's folder and the cache (:attr:`root`), and
sessions are made from the graph's bytes (a few hundred KB without weights) with that folder as the
external-data folder. The export's own locations are checked first (relative, no ``..``: the ONNX rule that
onnxruntime enforces on the export itself), so the wider folder lets the graph read nothing the export could
not.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence, Set
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from onnxgen.config import cache_home, default_threads, env_cache_off
from onnxgen.errors import OnnxgenError, UnsupportedModelError
from onnxgen.graph.decode_fusions import Fusions, fuse_for_decode, merge_pays
from onnxgen.graph.hidden_state import expose_hidden_state
from onnxgen.graph.hybrid_ops import FastOps, apply_fast_ops
from onnxgen.graph.int4_lm_head import int4_lm_head
from onnxgen.graph.logits_to_keep import keep_last_logits
from onnxgen.graph.mask_lengths import mask_feeds_lengths_only
from onnxgen.model.external_data import external_tensors, location_of, safe_location
from onnxgen.model.io import DecoderIO
from onnxgen.runtime.int4 import quantize_int4

log = logging.getLogger(__name__)

FORMAT = 5  # bumped when what a cache entry holds changes
GRAPH_FILE = "graph.onnx"
WEIGHTS_FILE = "weights.bin"
FACTS_FILE = "prepared.json"
INLINE_LIMIT = 64 << 10  # inline weights of at least this many bytes are moved to weights.bin
ALIGN = 4096  # onnxruntime maps an external tensor whose offset is page aligned
_HASHED_BYTES = 64 << 20  # model files up to this size are keyed by content, larger ones by size and time
KEEP_PER_MODEL = 4  # prepared graphs kept per model file (other settings, earlier versions of the model)
BUILD_PREFIX = ".build-"  # a folder an entry is written in before it is renamed into place
STALE_BUILD_S = 24 * 3600  # a build folder this old is left over whichever process made it


@dataclass(frozen=True)
class PassSettings:
    """What the passes are asked to do (part of the cache key)."""

    last_logits: bool = True  # add the logits-to-keep input
    tail_rows: bool = True  # ... and run the last layer's position-wise tail on the kept rows only
    on_cpu: bool = True  # CPU provider: fast ops, fusions, in-place states and length masks apply
    fast_ops: bool | None = None  # None: the pass decides
    fuse: bool = True
    # ... sibling MatMulNBits merged too: decided by the session's intra-op threads (decode_fusions.merge_pays)
    merge_matmuls: bool = True
    hidden_state: bool = False  # output the final hidden state (what an MTP head reads)
    int4_lm_head: bool = False  # a drafter's float lm_head as int4 (onnxgen.graph.int4_lm_head)


@dataclass
class SessionGraph:
    """The graph a session runs, the I/O and settings it was prepared for, and what the passes found in it.

    ``graph_path`` is the prepared graph in the cache (None: the export runs as it is, from
    ``model_path``); its weight locations are relative to ``root``. ``cache`` says how it was got:
    ``"hit"`` (read from the cache, no pass ran) or ``"miss"`` (prepared now and written).
    """

    model_path: Path
    io: DecoderIO
    settings: PassSettings
    graph_path: Path | None = None
    root: Path | None = None
    logits_to_keep: bool = False
    logits_reason: str = ""
    fast_ops: FastOps = field(default_factory=FastOps)
    fusions: Fusions = field(default_factory=Fusions)
    inplace_states: frozenset[str] = frozenset()
    length_mask: bool = False
    hidden_state: str | None = None  # the hidden-state output's name, where it was asked for
    cache: str = "miss"

    def source(self) -> tuple[str | bytes, Path | None]:
        """What onnxruntime loads (a path, or the prepared graph's bytes) and the folder its weight
        locations are relative to (None: the model's own folder)."""
        if self.graph_path is None:
            return str(self.model_path), None
        return self.graph_path.read_bytes(), self.root

    def load_graph(self) -> onnx.ModelProto:
        """The graph the session runs, weights by reference (for passes that rewrite it further)."""
        return onnx.load(str(self.graph_path or self.model_path), load_external_data=False)

    def still_on_disk(self) -> SessionGraph:
        """This graph, or the same prepared again where its cache entry was pruned since (another process,
        other settings)."""
        if self.graph_path is None or self.graph_path.is_file():
            return self
        return _with_defaults(prepare_session_graph(self.model_path, self.io, self.settings))

    @property
    def fast_ops_ran(self) -> bool:
        """Whether the fast-ops pass ran on this graph (a hybrid on the CPU, not turned off)."""
        return self.settings.on_cpu and bool(self.io.state_pairs) and not self.fast_ops.off

    def same_rewrites(self, graph: onnx.ModelProto, base_dir: Path) -> onnx.ModelProto:
        """``graph`` (a sibling of this graph's model, e.g. its Scans inlined) with the rewrites this graph
        got: logits-to-keep, fast ops, decode fusions, in that order. A sibling that runs some forwards of a
        decode state must round as the session on this graph does (plans are checked bit for bit), so it
        takes the same passes or none."""
        if self.logits_to_keep:
            kept = keep_last_logits(graph, self.io.logits, self.settings.tail_rows)
            if not kept.modified:
                raise UnsupportedModelError(f"the graph takes no logits-to-keep input: {kept.report}")
            graph = kept.model
        if self.fast_ops_ran:
            graph = apply_fast_ops(graph, True).model
        if self.settings.fuse:
            graph = fuse_for_decode(graph, base_dir, merge_matmuls=self.settings.merge_matmuls).model
        return graph

    def to_json(self) -> dict:
        """The facts ``prepared.json`` holds (:func:`_seal` adds the files' sizes and digest)."""
        return {
            "format": FORMAT,
            "model": str(model_identity(self.model_path)),
            "rewritten": self.graph_path is not None,
            "root": str(self.root) if self.root is not None else None,
            "logits_to_keep": self.logits_to_keep,
            "logits_reason": self.logits_reason,
            "fast_ops": asdict(self.fast_ops),
            "fusions": asdict(self.fusions),
            "inplace_states": sorted(self.inplace_states),
            "length_mask": self.length_mask,
            "hidden_state": self.hidden_state,
        }

    @classmethod
    def from_json(
        cls, facts: dict, model_path: Path, io: DecoderIO, settings: PassSettings, folder: Path
    ) -> SessionGraph:
        return cls(
            model_path=model_path,
            io=io,
            settings=settings,
            graph_path=folder / GRAPH_FILE if facts["rewritten"] else None,
            root=Path(facts["root"]) if facts["root"] else None,
            logits_to_keep=facts["logits_to_keep"],
            logits_reason=facts["logits_reason"],
            fast_ops=FastOps(**facts["fast_ops"]),
            fusions=Fusions(**facts["fusions"]),
            inplace_states=frozenset(facts["inplace_states"]),
            length_mask=facts["length_mask"],
            hidden_state=facts["hidden_state"],
            cache="hit",
        )


# -- the cache's folder and key ---------------------------------------------------------------------------


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else a folder of this process only (removed at exit) where ``$ONNXGEN_CACHE`` is off,
    else ``$ONNXGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/onnxgen``, else ``~/.cache/onnxgen``."""
    if cache_dir is not None:
        return Path(cache_dir)
    if env_cache_off():
        return _process_folder()
    return cache_home()


_PROCESS: list[Path] = []  # this process's own cache folder, made on first use


def _process_folder() -> Path:
    """A cache folder for this process only, removed when it exits."""
    if not _PROCESS:
        _PROCESS.append(Path(tempfile.mkdtemp(prefix="onnxgen-cache-")))
        atexit.register(shutil.rmtree, _PROCESS[0], True)
    return _PROCESS[0]


def _writable_root(cache_dir: str | Path | None) -> Path:
    """The graphs folder of the cache; this process's own folder (removed at exit) where it cannot be made."""
    root = cache_root(cache_dir) / "graphs"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    fallback = _process_folder() / "graphs"
    if not fallback.is_dir():
        fallback.mkdir(parents=True)
        log.warning(
            "the cache folder %s cannot be written; prepared graphs go to %s for this process only "
            "(set ONNXGEN_CACHE_DIR to a writable folder to keep them)",
            root,
            fallback,
        )
    return fallback


def model_identity(model_path: Path) -> Path:
    """``model_path`` with its folder resolved but not the file itself: a model file that is a link (as
    in a Hugging Face hub cache, where it points into a folder of blobs) keeps its external data beside
    the link, not beside the link's target."""
    return model_path.parent.resolve() / model_path.name


def _file_identity(path: Path, hashed: bool) -> bytes:
    st = path.stat()
    if hashed and st.st_size <= _HASHED_BYTES:
        return hashlib.sha256(path.read_bytes()).digest()
    return f"{st.st_size}:{st.st_mtime_ns}".encode()


def cache_key(model_path: Path, graph: onnx.ModelProto, io: DecoderIO, settings: PassSettings) -> str:
    """Changes with the model file and its data files, their folder, the settings, the decoder's derived
    I/O and onnxgen's and onnxruntime's versions."""
    from onnxgen import __version__

    model_path = model_identity(model_path)
    h = hashlib.sha256(f"{FORMAT}|{__version__}|{ort.__version__}|{model_path}".encode())
    h.update(_file_identity(model_path, hashed=True))
    for location in sorted({location_of(t) for t in external_tensors(graph)}):
        h.update(location.encode() + b"=" + _file_identity(model_path.parent / location, hashed=False))
    # the whole derived I/O (ports, KV layout, static cache, states; not its notes): passes and analyses read it
    derived = replace(io, notes=())
    h.update(repr((asdict(settings), derived)).encode())
    return h.hexdigest()[:24]


def inplace_states(graph: onnx.ModelProto, io: DecoderIO) -> frozenset[str]:
    """The recurrent-state inputs that a forward may update in place (input and output bound to one
    buffer): each is read by one node only, a ``com.microsoft::LinearAttention`` without a state window
    that writes the state's present output itself. onnxruntime's CPU kernel of that op copies the past
    state into the present one and then updates the present one alone, so it gives the same result when
    both are one buffer (tests check it bit for bit against double buffering). Other state ops are left
    double-buffered (CausalConvWithState in place measured no faster)."""
    consumers: dict[str, int] = {}
    for node in graph.graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    found = set()
    for node in graph.graph.node:
        if node.domain != "com.microsoft" or node.op_type != "LinearAttention" or len(node.input) < 4:
            continue
        if any(a.name == "state_window" and a.i for a in node.attribute) or len(node.output) < 2:
            continue
        for pair in io.state_pairs:
            if node.input[3] == pair.input and node.output[1] == pair.output and consumers[pair.input] == 1:
                found.add(pair.input)
    return frozenset(found)


# -- preparing ----------------------------------------------------------------------------------------------


def session_graph(
    model_path: str | Path,
    io: DecoderIO,
    *,
    providers: Sequence[str] | None = None,
    graph: onnx.ModelProto | None = None,
    last_logits: bool = True,
    fast_ops: bool | None = None,
    fuse: bool | None = None,
    hidden_state: bool = False,
    int4_lm_head: bool = False,
    cache_dir: str | Path | None = None,
    tail_rows: bool = True,
    threads: int | None = None,
) -> SessionGraph:
    """The graph a session on ``providers`` (default: the CPU) runs for the export at ``model_path``, whose
    graph (weights not loaded) is ``graph`` when the caller has it: logits for the kept positions only
    (``last_logits``; with ``tail_rows`` the last layer's position-wise tail also runs on the kept rows
    only, :mod:`onnxgen.graph.kept_rows`); on the CPU, hybrid contrib ops on onnxruntime's vectorized kernels
    (:mod:`onnxgen.graph.hybrid_ops`: the same math, rounded differently; ``fast_ops``) and fewer kernel
    launches per decode step with the same output bits (:mod:`onnxgen.graph.decode_fusions`; ``fuse``; its
    sibling MatMulNBits merged only where the session's ``threads`` intra-op threads, None: one per core,
    make it pay); the final hidden state as an output where ``hidden_state`` (what an MTP head drafts
    from); and the analyses a session reads. Prepared once per model and settings and kept on disk; every
    weight stays in its file."""
    providers = list(providers or ["CPUExecutionProvider"])
    on_cpu = providers[0] == "CPUExecutionProvider"
    fusing = on_cpu and fuse is not False
    settings = PassSettings(
        last_logits=last_logits,
        tail_rows=tail_rows,
        on_cpu=on_cpu,
        fast_ops=fast_ops,
        fuse=fusing,
        # without fusions the graph does not depend on the threads: one cache entry for every count
        merge_matmuls=fusing and merge_pays(threads or default_threads()),
        hidden_state=hidden_state,
        int4_lm_head=int4_lm_head,
    )
    prepared = _with_defaults(prepare_session_graph(Path(model_path), io, settings, graph, cache_dir))
    if hidden_state and prepared.hidden_state is None:
        raise UnsupportedModelError(
            f"{model_path} does not output its final hidden state, which an MTP head needs, and the "
            "graph passes that would add it did not run (see the warning above)"
        )
    if prepared.fast_ops.skipped:
        log.info("hybrid ops left as exported: %s", prepared.fast_ops.skipped)
    if prepared.fast_ops.off and on_cpu and io.state_pairs:
        log.info("hybrid ops run as exported: %s", prepared.fast_ops.off)
    if prepared.fusions.rewritten:
        log.info(
            "decode fusions: %d MatMulNBits merged, %d query/key norm pairs merged",
            prepared.fusions.merged_matmuls,
            prepared.fusions.merged_norms,
        )
    for why in prepared.fusions.skipped:
        log.info("decode fusion left out: %s", why)
    return prepared


def _with_defaults(prepared: SessionGraph) -> SessionGraph:
    """``prepared`` saying why the fast-ops pass did not run where it does not apply at all."""
    if not (prepared.settings.on_cpu and prepared.io.state_pairs):
        prepared.fast_ops = FastOps(off="not a hybrid on onnxruntime's CPU provider")
    return prepared


def prepare_session_graph(
    model_path: Path,
    io: DecoderIO,
    settings: PassSettings,
    graph: onnx.ModelProto | None = None,
    cache_dir: str | Path | None = None,
) -> SessionGraph:
    """The session graph of the export at ``model_path`` (whose graph, weights not loaded, is ``graph``
    when the caller has it): read from the cache, or prepared and written to it."""
    model_path = Path(model_path)
    if graph is None:
        graph = onnx.load(str(model_path), load_external_data=False)
    key = cache_key(model_path, graph, io, settings)
    root = _writable_root(cache_dir)
    folder = root / key
    cached = _read(folder, model_path, io, settings)
    if cached is not None:
        os.utime(folder / FACTS_FILE)  # last used: what pruning keeps
        return cached
    if folder.exists():
        log.warning("the prepared graph in %s is damaged or incomplete; preparing it again", folder)
        _remove(folder)
    _prune(root, model_path, KEEP_PER_MODEL - 1)
    build = Path(tempfile.mkdtemp(prefix=f"{BUILD_PREFIX}{os.getpid()}-", dir=root))
    try:
        prepared = _prepare(model_path, graph, io, settings, build, folder)
        _seal(build, prepared)
        try:
            build.rename(folder)
        except OSError:  # another process wrote it first: use theirs where it is whole
            cached = _read(folder, model_path, io, settings)
            if cached is not None:
                return cached
            _remove(folder)
            build.rename(folder)
        _sync(root)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return prepared


def _sync(path: Path) -> None:
    """Flush ``path`` (a file, or a folder's entries) to the disk."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() and hasattr(os, "O_DIRECTORY") else 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # a platform that cannot open folders: the rename is as durable as it gets
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _seal(build: Path, prepared: SessionGraph) -> None:
    """Write ``prepared.json`` last, with the graph's digest and the weights' size, and sync every file
    and the folder, so a renamed entry is whole."""
    facts = prepared.to_json()
    graph, weights = build / GRAPH_FILE, build / WEIGHTS_FILE
    facts["graph_sha256"] = hashlib.sha256(graph.read_bytes()).hexdigest() if graph.is_file() else None
    facts["weights_bytes"] = weights.stat().st_size if weights.is_file() else None
    for path in (graph, weights):
        if path.is_file():
            _sync(path)
    (build / FACTS_FILE).write_text(json.dumps(facts, indent=1))
    _sync(build / FACTS_FILE)
    _sync(build)


def _remove(folder: Path) -> None:
    """Remove an entry: renamed aside first (a rename is atomic), so no reader finds it half removed."""
    aside = folder.with_name(f"{BUILD_PREFIX}{os.getpid()}-removed-{folder.name}")
    try:
        folder.rename(aside)
    except OSError:
        aside = folder  # gone already, or on a system that will not rename it: remove it in place
    shutil.rmtree(aside, ignore_errors=True)


def _stale_build(folder: Path) -> bool:
    """Whether ``folder`` is a build folder no running process writes: its process is gone, or it is
    older than :data:`STALE_BUILD_S` (a cache shared by several machines)."""
    try:
        age = time.time() - folder.stat().st_mtime
    except OSError:
        return False
    pid = folder.name[len(BUILD_PREFIX) :].split("-", 1)[0]
    if age > STALE_BUILD_S:
        return True
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, owned by another user
        return False
    return False


def _prune(root: Path, model_path: Path, keep: int) -> None:
    """Remove all but the ``keep`` most recently used prepared graphs of ``model_path``: entries of a
    model that changed since, or of settings no longer used, would otherwise stay forever."""
    target = str(model_identity(model_path))
    entries = []
    for folder in root.iterdir():
        if folder.name.startswith(BUILD_PREFIX):
            if _stale_build(folder):
                shutil.rmtree(folder, ignore_errors=True)
            continue
        try:
            facts = json.loads((folder / FACTS_FILE).read_text())
            if facts.get("model") == target:
                entries.append(((folder / FACTS_FILE).stat().st_mtime, folder))
        except (OSError, ValueError):
            continue
    for _, folder in sorted(entries, reverse=True)[keep:]:
        shutil.rmtree(folder, ignore_errors=True)


def _read(folder: Path, model_path: Path, io: DecoderIO, settings: PassSettings) -> SessionGraph | None:
    """The entry in ``folder``, or None where there is none or it is not whole (:func:`_seal`)."""
    try:
        facts = json.loads((folder / FACTS_FILE).read_text())
        if not isinstance(facts, dict) or facts.get("format") != FORMAT:
            return None
        if facts["rewritten"]:
            graph = (folder / GRAPH_FILE).read_bytes()
            if hashlib.sha256(graph).hexdigest() != facts["graph_sha256"]:
                return None
        weights = folder / WEIGHTS_FILE
        size = weights.stat().st_size if weights.is_file() else None
        if size != facts["weights_bytes"]:
            return None
        return SessionGraph.from_json(facts, model_path, io, settings, folder)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _drafter_lm_head(graph: onnx.ModelProto, io: DecoderIO, base: Path) -> onnx.ModelProto:
    """``graph`` with its lm_head as int4 (cheaper drafts), or as it is where that does not apply or this
    onnxruntime has no quantizer: the exact lm_head drafts as well."""
    try:
        quantized = int4_lm_head(graph, io.logits, base, quantize_int4)
    except OnnxgenError as e:
        log.warning("the drafter's lm_head is left as it is: %s", e)
        return graph
    if not quantized.modified:
        log.info("the drafter's lm_head is left as it is: %s", quantized.report)
    return quantized.model


def _prepare(
    model_path: Path,
    graph: onnx.ModelProto,
    io: DecoderIO,
    settings: PassSettings,
    build: Path,
    folder: Path,
) -> SessionGraph:
    """Run the passes on ``graph`` (new weights into ``build/weights.bin``) and save what changed."""
    base = model_path.parent
    out = SessionGraph(model_path, io, settings, cache="miss")
    try:
        root = Path(os.path.commonpath([base.resolve(), folder.parent.resolve()]))
    except ValueError:  # no folder holds both (Windows drives): the export runs as it is
        log.warning(
            "%s and the cache %s share no folder, so the graph passes are left out; set "
            "ONNXGEN_CACHE_DIR to a folder on the model's drive",
            base,
            folder.parent,
        )
        if settings.hidden_state:  # usable where the export already outputs it
            exposed = expose_hidden_state(graph, io.logits)
            out.hidden_state = None if exposed.modified else exposed.output
        return _analyses(out, graph, io, settings)
    original = graph
    if settings.hidden_state:  # first: the later passes keep the output, and it holds every position
        exposed = expose_hidden_state(graph, io.logits)
        if exposed.output is None:
            raise UnsupportedModelError(
                f"{model_path} does not show its final hidden state, which an MTP head needs: {exposed.report}"
            )
        graph, out.hidden_state = exposed.model, exposed.output
    if settings.int4_lm_head:
        graph = _drafter_lm_head(graph, io, base)
    if settings.last_logits:
        kept = keep_last_logits(graph, io.logits, settings.tail_rows)
        graph, out.logits_to_keep, out.logits_reason = kept.model, kept.modified, kept.report
        if not out.logits_to_keep:
            log.info("logits are computed for every position: %s", out.logits_reason)
    with WeightFile(build / WEIGHTS_FILE, folder / WEIGHTS_FILE) as weights:
        if settings.on_cpu and io.state_pairs:
            fast = apply_fast_ops(graph, settings.fast_ops)
            graph, out.fast_ops = fast.model, fast.report
        if settings.on_cpu and settings.fuse:
            fused = fuse_for_decode(graph, base, store=weights.store, merge_matmuls=settings.merge_matmuls)
            graph, out.fusions = fused.model, fused.report
        _analyses(out, graph, io, settings)
        if graph is original and not weights.used and model_path.suffix != ".textproto":
            return out  # nothing rewritten: the session loads the export itself (onnxruntime reads no text)
        if graph is original:
            graph = _copy(graph)
        _externalize(graph, weights)
    out.root = root
    relocate(graph, base.resolve(), root, weights.names, folder.resolve())
    onnx.save(graph, str(build / GRAPH_FILE))
    out.graph_path = folder / GRAPH_FILE
    return out


def _analyses(
    out: SessionGraph, graph: onnx.ModelProto, io: DecoderIO, settings: PassSettings
) -> SessionGraph:
    """What the session reads off the graph it runs: the states updated in place, the length-only mask."""
    if settings.on_cpu and io.state_pairs:
        out.inplace_states = inplace_states(graph, io)
    if settings.on_cpu and io.attention_mask is not None and io.past_present_share_buffer:
        out.length_mask = mask_feeds_lengths_only(graph, io.attention_mask)
    return out


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def relocate(
    model: onnx.ModelProto, base: Path, root: Path, names: Set[str] = frozenset(), folder: Path | None = None
) -> None:
    """Rewrite every external location of ``model`` relative to ``root``: the tensors ``names`` lie in
    ``folder``, the others in ``base``."""
    for t in external_tensors(model):
        path = (folder if t.name in names and folder is not None else base) / safe_location(location_of(t))
        for e in t.external_data:
            if e.key == "location":
                e.value = os.path.relpath(path, root)


def _subgraph_reads(model: onnx.ModelProto) -> set[str]:
    """Names that nodes inside subgraphs (Scan, Loop, If bodies) read: kept inline, where a pass that
    copies such a body into another graph can take them along."""
    names: set[str] = set()

    def visit(graph: onnx.GraphProto, nested: bool) -> None:
        for node in graph.node:
            if nested:
                names.update(node.input)
            for attr in node.attribute:
                for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    visit(g, True)

    visit(model.graph, False)
    return names


def _externalize(model: onnx.ModelProto, weights: WeightFile) -> None:
    """Move the main graph's inline initializers of at least ``INLINE_LIMIT`` bytes to ``weights``."""
    keep = _subgraph_reads(model)
    for i, t in enumerate(model.graph.initializer):
        if t.data_location == onnx.TensorProto.EXTERNAL or t.name in keep:
            continue
        if len(t.raw_data) >= INLINE_LIMIT or t.ByteSize() >= 2 * INLINE_LIMIT:
            model.graph.initializer[i].CopyFrom(weights.store(t.name, numpy_helper.to_array(t)))


class WeightFile:
    """Tensors appended to one file at page-aligned offsets; :meth:`store` returns each one's reference.

    ``path`` is where it is written, ``final`` where it will be read from (the references name its file).
    """

    def __init__(self, path: Path, final: Path) -> None:
        self.path = path
        self.name = final.name
        self._file: BinaryIO | None = None
        self._offset = 0
        self.names: set[str] = set()  # the tensors written to the file

    @property
    def used(self) -> bool:
        return bool(self.names)

    def __enter__(self) -> WeightFile:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()

    def store(self, name: str, array: np.ndarray) -> onnx.TensorProto:
        """``array`` as the initializer ``name``: small ones inline, others appended to the file."""
        if array.nbytes < ALIGN:
            return numpy_helper.from_array(array, name)
        if self._file is None:
            self._file = open(self.path, "wb")  # noqa: SIM115 - closed by __exit__
        pad = -self._offset % ALIGN
        data = np.ascontiguousarray(array).tobytes()
        self._file.write(b"\0" * pad + data)
        offset, self._offset = self._offset + pad, self._offset + pad + len(data)
        self.names.add(name)
        out = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
        out.dims.extend(array.shape)
        out.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", self.name), ("offset", str(offset)), ("length", str(len(data)))):
            out.external_data.add(key=key, value=value)
        return out


def cached_graphs(cache_dir: str | Path | None = None) -> Iterator[Path]:
    """The prepared graphs in the cache (folders)."""
    root = cache_root(cache_dir) / "graphs"
    if root.is_dir():
        yield from (p for p in root.iterdir() if (p / FACTS_FILE).is_file())
