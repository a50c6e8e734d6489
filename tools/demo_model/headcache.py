"""Training the MTP head alone (``head_only``) from cached decoder outputs.

With the decoder frozen, its forward over a training row is the same at every step, and it is most of a
joint step's cost (8 layers over every token, against the head's one layer). So the decoder runs once:
:func:`build_cache` writes its final hidden states (the final norm's output, the lm_head's input: what the
head reads) over a fixed, seeded set of training rows to ``OUT/train/head_cache/``, and :func:`train_head`
trains the head from them. A step is then the head's layer, ``fc`` and the tied logits over
``head_batch`` crops of ``head_context`` positions from random cached rows.

The states come from the decoder's ONNX export (``init_from``) on onnxruntime when it is there: the very
states onnxgen feeds the head when it drafts, whose argmax is the greedy token speculation must match, and
several times faster on a CPU than the training's torch forward; otherwise from the torch decoder. The
cache is keyed by a digest of the decoder (the export's files, or the torch weights), the rows and the
settings that chose them; a run whose key differs rebuilds it, so a changed decoder never trains against
stale states.

The loss mixes two targets for the head's prediction of token ``t+2``: the decoder's own next-token
distribution at ``t+1`` (a KL divergence, weight ``head_distill``) and the text's token (cross-entropy,
weight ``1 - head_distill``). What greedy speculation accepts is the decoder's argmax, not the text's
token, and the decoder's distribution comes free from the cache: the tied lm_head over the cached hidden
state at ``t+1``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tools.demo_model.config import DemoConfig
from tools.demo_model.data import batch_at, val_windows
from tools.demo_model.tokenizer import FIRST_ORDINARY_ID

CACHE_DIR = "head_cache"


@dataclass(frozen=True)
class HiddenCache:
    """``ids [rows, seq + 1]`` (int64) and ``hidden [rows, seq, hidden]`` (float32): the decoder's final
    hidden state after reading ``ids[:, : t + 1]`` at each position ``t``."""

    ids: np.ndarray
    hidden: np.ndarray


def export_digest(export_dir: Path) -> str:
    """sha256 over the decoder export's graph and weights."""
    digest = hashlib.sha256()
    for name in ("model.onnx", "model.onnx.data"):
        digest.update(name.encode())
        with (export_dir / name).open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def export_forward(export_dir: Path) -> Any:
    """``rows [b, seq + 1] -> hidden [b, seq, H]``: the export's final hidden states over ``rows[:, :-1]``
    (onnxruntime, one prefill from empty caches)."""
    from tools.demo_model.measure import prefill_hidden_fn

    run = prefill_hidden_fn(export_dir)
    return lambda rows: run(np.ascontiguousarray(rows[:, :-1]))[1]


def decoder_digest(lm: Any) -> str:
    """sha256 over the decoder's tensors (names, shapes and bytes): changes whenever a weight does."""
    digest = hashlib.sha256()
    for name, tensor in sorted(lm.state_dict().items()):
        array = tensor.detach().cpu().contiguous().numpy()
        digest.update(f"{name}{tuple(array.shape)}{array.dtype}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def training_rows(config: DemoConfig, train_ids: np.ndarray) -> np.ndarray:
    """The ``head_rows`` cached rows ``[head_rows, seq_len + 1]``: the decoder's main-schedule mix
    (:func:`tools.demo_model.data.batch_at`, steps 0, 1, ... of ``seed``), ``batch`` rows a step."""
    shares = config.row_shares(0)
    steps = -(-config.head_rows // config.batch)
    rows = [
        batch_at(
            train_ids,
            step,
            config.batch,
            config.seq_len,
            config.seed,
            shares[0],
            shares[1],
            (FIRST_ORDINARY_ID, config.vocab_size),
            shares[2],
            config.quote_span,
            config.quote_gap,
        )
        for step in range(steps)
    ]
    return np.concatenate(rows)[: config.head_rows]


def final_hidden(lm: Any, rows: np.ndarray, batch: int = 4) -> np.ndarray:
    """The decoder's final hidden states ``[rows, seq, hidden]`` over ``rows[:, :-1]``."""
    import torch

    from tools.demo_model.gdn import fast_gated_delta_rule

    out = []
    with torch.no_grad(), fast_gated_delta_rule():
        for i in range(0, len(rows), batch):
            ids = torch.from_numpy(np.ascontiguousarray(rows[i : i + batch, :-1]))
            out.append(lm.model(input_ids=ids).last_hidden_state.numpy())
    return np.concatenate(out)


def build_cache(
    forward: Any, digest: str, rows: np.ndarray, directory: Path, key: dict[str, Any], log: Any = print
) -> HiddenCache:
    """``forward(rows)`` (the decoder's hidden states ``[b, seq, H]`` over ``rows[:, :-1]``) over ``rows``,
    from ``directory`` when it holds them under the same ``key``, decoder ``digest`` and rows, else
    computed in chunks and written there (memory-mapped on reading)."""
    full_key = {**key, "decoder_sha256": digest, "rows_sha256": _sha(rows)}
    meta = directory / "meta.json"
    if meta.is_file() and json.loads(meta.read_text()) == full_key:
        log(f"head cache: reusing {directory}")
        return HiddenCache(np.load(directory / "ids.npy"), np.load(directory / "hidden.npy", mmap_mode="r"))
    if directory.exists():
        log(f"head cache: {directory} was made for another decoder or other rows; rebuilding")
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    t0 = time.time()
    chunk = 8
    first = forward(rows[:chunk])
    hidden = np.lib.format.open_memmap(
        directory / "hidden.tmp.npy", mode="w+", dtype=np.float32, shape=(len(rows), *first.shape[1:])
    )
    for i in range(0, len(rows), chunk):
        hidden[i : i + chunk] = first if i == 0 else forward(rows[i : i + chunk])
        if (i // chunk) % 32 == 31:
            log(f"head cache: {i + len(rows[i : i + chunk])}/{len(rows)} rows ({time.time() - t0:.0f} s)")
    hidden.flush()
    del hidden
    (directory / "hidden.tmp.npy").replace(directory / "hidden.npy")
    np.save(directory / "ids.npy", rows)
    meta.write_text(json.dumps(full_key, indent=2) + "\n")  # last: a cache without it is incomplete
    log(f"head cache: {rows.size} tokens in {time.time() - t0:.0f} s, {directory}")
    return HiddenCache(rows, np.load(directory / "hidden.npy", mmap_mode="r"))


def _sha(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


@dataclass(frozen=True)
class Caches:
    """What head-only training reads: text rows (``train``) and held-out windows (``val``), and, with
    ``head_generated``, the decoder's own greedy continuations of training and held-out prompts."""

    train: HiddenCache
    val: HiddenCache
    generated: HiddenCache | None = None
    generated_val: HiddenCache | None = None


def greedy_export(export_dir: Path) -> Any:
    """``(prompt ids, n) -> n greedy ids`` of the export on onnxgen (prompt lookup drafts: same tokens)."""
    import onnxgen

    llm = onnxgen.load(export_dir, threads=1, speculative=True)

    def run(prompt: list[int], new_tokens: int) -> list[int]:
        params = onnxgen.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        return list(llm.generate(prompt, params, speculative=onnxgen.PromptLookup()).token_ids)

    return run


def greedy_torch(lm: Any) -> Any:
    """``(prompt ids, n) -> n greedy ids`` of the torch decoder (a full forward per token: small models)."""
    import torch

    def run(prompt: list[int], new_tokens: int) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(new_tokens):
                ids.append(int(lm(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    return run


def generated_rows(
    greedy: Any, stream: np.ndarray, count: int, prompt_len: int, new_tokens: int, seed: int, log: Any = print
) -> np.ndarray:
    """``[count, prompt_len + new_tokens]``: prompts of ``prompt_len`` ids at seeded places of ``stream``,
    each followed by the decoder's greedy continuation (what the head reads when it drafts)."""
    rng = np.random.default_rng([seed, 2])
    starts = rng.integers(0, stream.size - prompt_len, size=count)
    rows, t0 = [], time.time()
    for i, start in enumerate(starts):
        prompt = stream[start : start + prompt_len].astype(np.int64).tolist()
        rows.append(prompt + greedy(prompt, new_tokens))
        if i % 32 == 31:
            log(f"head cache: {i + 1}/{count} greedy continuations ({time.time() - t0:.0f} s)")
    return np.asarray(rows, dtype=np.int64)


def caches(
    lm: Any, config: DemoConfig, train_ids: np.ndarray, val_ids: np.ndarray, work: Path, log: Any = print
) -> Caches:
    """The caches under ``work/head_cache/``: the training rows (:func:`training_rows`), the validation
    windows (every one, or the first ``eval_windows``), and with ``head_generated`` the decoder's greedy
    continuations of that many training prompts and of a quarter as many held-out ones. From the export
    ``config.init_from`` when it has one, else from the torch decoder ``lm``."""
    export = Path(config.init_from) if config.init_from else None
    on_export = export is not None and (export / "model.onnx").is_file()
    if on_export:
        forward, digest = export_forward(export), "onnx:" + export_digest(export)
    else:
        forward, digest = (lambda rows: final_hidden(lm, rows)), "torch:" + decoder_digest(lm)
    settings = {
        "seed": config.seed,
        "seq_len": config.seq_len,
        "head_rows": config.head_rows,
        "batch": config.batch,
        "shares": list(config.row_shares(0)),
        "quote": [config.quote_span, config.quote_gap],
    }
    root = work / CACHE_DIR
    train = build_cache(forward, digest, training_rows(config, train_ids), root / "train", settings, log)
    windows = val_windows(val_ids, config.seq_len, config.eval_windows)
    val = build_cache(forward, digest, windows, root / "val", {"seq_len": config.seq_len}, log)
    if config.head_generated <= 0:
        return Caches(train, val)
    made = {"prompt": config.head_prompt, "new_tokens": config.head_new_tokens, "seed": config.seed}
    caches_made = []
    for name, stream, count in (
        ("generated", train_ids, config.head_generated),
        ("generated_val", val_ids, max(1, config.head_generated // 4)),
    ):
        key = {**made, "rows": count, "stream_sha256": _sha(stream)}
        rows = _reuse_rows(root / name, key, digest)
        if rows is None:
            greedy = greedy_export(export) if on_export else greedy_torch(lm)  # type: ignore[arg-type]
            rows = generated_rows(
                greedy, stream, count, config.head_prompt, config.head_new_tokens, config.seed, log
            )
        caches_made.append(build_cache(forward, digest, rows, root / name, key, log))
    return Caches(train, val, *caches_made)


def _reuse_rows(directory: Path, key: dict[str, Any], digest: str) -> np.ndarray | None:
    """The rows of a cache made under ``key`` by decoder ``digest`` (generating them again is the cost)."""
    meta = directory / "meta.json"
    if not meta.is_file():
        return None
    written = json.loads(meta.read_text())
    if written.get("decoder_sha256") != digest or {k: written.get(k) for k in key} != key:
        return None
    return np.load(directory / "ids.npy")


def crops(
    cache: HiddenCache, step: int, config: DemoConfig, stream: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s ``head_batch`` training crops, drawn from ``(seed, step, stream)`` alone: ``hidden [b, n + 1, H]`` (the
    decoder's states at positions ``o .. o + n``) and ``ids [b, n + 2]`` (tokens ``o .. o + n + 1``), with
    ``n = min(head_context, seq_len - 1)``."""
    seq = cache.hidden.shape[1]
    n = min(config.head_context, seq - 1)
    rng = np.random.default_rng([config.seed, step, 1 + stream])
    rows = rng.integers(0, cache.hidden.shape[0], size=config.head_batch)
    starts = rng.integers(0, seq - n, size=config.head_batch)
    hidden = np.stack([cache.hidden[r, o : o + n + 1] for r, o in zip(rows, starts, strict=True)])
    ids = np.stack([cache.ids[r, o : o + n + 2] for r, o in zip(rows, starts, strict=True)])
    return hidden.astype(np.float32), ids


def head_losses(model: Any, hidden: Any, ids: Any, distill: float) -> tuple[Any, Any, Any]:
    """Per-position loss ``[b, n]`` of the head over a crop (``hidden [b, n + 1, H]``, ``ids [b, n + 2]``:
    the head reads ``hidden[:, t]`` and ``ids[:, t + 1]`` and predicts ``ids[:, t + 2]``), the head's
    argmax and the decoder's greedy token there (both ``[b, n]``). The loss is ``distill`` times the KL
    divergence from the decoder's distribution (its tied lm_head over ``hidden[:, t + 1]``) plus
    ``1 - distill`` times the cross-entropy of the text's token."""
    import torch
    import torch.nn.functional as F

    from tools.demo_model.model import head_logits

    logits = head_logits(model.lm, model.mtp, hidden[:, :-1], ids[:, 1:-1])
    logp = F.log_softmax(logits, -1)
    with torch.no_grad():
        teacher = F.log_softmax(model.lm.lm_head(hidden[:, 1:]), -1)
    loss = torch.zeros(logp.shape[:-1])
    if distill > 0:
        loss = loss + distill * (teacher.exp() * (teacher - logp)).sum(-1)
    if distill < 1:
        text = -logp.gather(-1, ids[:, 2:, None]).squeeze(-1)
        loss = loss + (1 - distill) * text
    return loss, logits.argmax(-1), teacher.argmax(-1)


def evaluate_cached(model: Any, cache: HiddenCache, distill: float, batch: int = 8) -> dict[str, float]:
    """The head's loss over every position of the validation cache, its agreement with the decoder's own
    greedy token after next (a first draft's acceptance under greedy decoding, teacher-forced), and its
    accuracy on the text's token after next."""
    import torch

    total, agree, correct, count = 0.0, 0, 0, 0
    with torch.no_grad():
        for i in range(0, cache.hidden.shape[0], batch):
            hidden = torch.from_numpy(np.array(cache.hidden[i : i + batch], dtype=np.float32))
            ids = torch.from_numpy(cache.ids[i : i + batch])
            losses, drafts, greedy = head_losses(model, hidden, ids, distill)
            total += float(losses.sum())
            agree += int((drafts == greedy).sum())
            correct += int((drafts == ids[:, 2:]).sum())
            count += losses.numel()
    return {"val_mtp_loss": total / count, "val_mtp_agree": agree / count, "val_mtp_correct": correct / count}


def _step_losses(model: Any, caches: Caches, step: int, config: DemoConfig) -> tuple[Any, Any, Any]:
    """Step ``step``'s losses, drafts and greedy targets (flattened): ``head_batch`` crops of the text
    rows, or half of them from the greedy continuations when there are some."""
    import torch

    parts = [(caches.train, config)]
    if caches.generated is not None:
        half = max(1, config.head_batch // 2)
        parts = [
            (caches.train, dataclasses.replace(config, head_batch=config.head_batch - half)),
            (caches.generated, dataclasses.replace(config, head_batch=half)),
        ]
    out = []
    for i, (cache, part) in enumerate(parts):
        hidden, ids = crops(cache, step, part, stream=i)
        losses, drafts, greedy = head_losses(
            model, torch.from_numpy(hidden), torch.from_numpy(ids), part.head_distill
        )
        out.append((losses.flatten(), drafts.flatten(), greedy.flatten()))
    return tuple(torch.cat(x) for x in zip(*out, strict=True))  # type: ignore[return-value]


def train_head(
    model: Any,
    opt: Any,
    config: DemoConfig,
    caches: Caches,
    steps: range,
    work: Path,
    learning_rate: Any,
    save: Any,
    log: Any = print,
) -> None:
    """Steps ``steps`` of head-only training from the caches; logs and checkpoints as the joint loop does
    (``save(step)`` every ``checkpoint_every`` steps, at evaluations and after the last step)."""
    import torch

    record = (work / "train_log.jsonl").open("a")
    model.train()
    t0, positions = time.time(), 0
    for step in steps:
        for group in opt.param_groups:
            group["lr"] = learning_rate(config, step)
        losses, drafts, greedy = _step_losses(model, caches, step, config)
        loss = losses.mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.mtp.parameters(), config.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        positions += losses.numel()
        done = step + 1
        entry: dict[str, Any] = {
            "step": done,
            "mtp_loss": round(loss.item(), 4),
            "mtp_agree": round((drafts == greedy).float().mean().item(), 4),
        }
        if done % 10 == 0 or done == config.total_steps:
            elapsed = time.time() - t0
            entry.update(lr=round(learning_rate(config, step), 6), grad_norm=round(norm.item(), 3))
            entry.update(elapsed_s=round(elapsed, 1), positions_per_s=round(positions / elapsed))
        if done % config.eval_every == 0 or done == config.total_steps:
            model.eval()
            scores = evaluate_cached(model, caches.val, config.head_distill)
            if caches.generated_val is not None:
                on_generated = evaluate_cached(model, caches.generated_val, config.head_distill)
                scores["val_gen_agree"] = on_generated["val_mtp_agree"]
            entry.update({k: round(v, 4) for k, v in scores.items()})
            model.train()
            save(done)
        elif done % config.checkpoint_every == 0 or done == steps.stop:
            save(done)
        record.write(json.dumps(entry) + "\n")
        record.flush()
        if "lr" in entry or "val_mtp_loss" in entry:
            log(" ".join(f"{k}={v}" for k, v in entry.items()))
    record.close()
