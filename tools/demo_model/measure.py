"""Measurements of the demo model: held-out loss (torch and ONNX), generations, and copy behaviour.

Used by :mod:`tools.demo_model.report`. The torch measurement needs torch/transformers; the ONNX ones run
on onnxruntime alone (plus onnxruntime-genai for the cross-check).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tools.demo_model.data import val_windows


@dataclass(frozen=True)
class Loss:
    """Mean cross-entropy over ``tokens`` scored tokens that decode to ``bytes`` UTF-8 bytes."""

    nats: float
    tokens: int
    bytes: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nats)

    @property
    def bits_per_byte(self) -> float:
        return self.nats * self.tokens / math.log(2) / self.bytes


def _scored_bytes(windows: np.ndarray, decode: Any) -> int:
    return sum(len(decode(w[1:].tolist()).encode()) for w in windows)


def torch_loss(hf_dir: Path, val: np.ndarray, seq_len: int, decode: Any) -> Loss:
    """Loss of the saved HF checkpoint on every validation window."""
    from transformers import Qwen3_5ForConditionalGeneration

    from tools.demo_model.gdn import fast_gated_delta_rule
    from tools.demo_model.trainer import evaluate

    model = Qwen3_5ForConditionalGeneration.from_pretrained(hf_dir).float().eval()
    with fast_gated_delta_rule():
        nats = evaluate(model, val, seq_len, None)
    windows = val_windows(val, seq_len)
    return Loss(nats, windows[:, 1:].size, _scored_bytes(windows, decode))


def prefill_logits_fn(model_dir: Path) -> Any:
    """A function ``ids [b, t] -> logits [b, t, vocab]`` running one prefill of an onnxruntime-genai
    hybrid export on plain onnxruntime, from empty caches (KV past of length 0, zero states)."""
    run = _prefill_fn(model_dir, hidden=False)
    return lambda ids: run(ids)[0]


def prefill_hidden_fn(model_dir: Path) -> Any:
    """Like :func:`prefill_logits_fn`, returning ``(logits, hidden)``: ``hidden [b, t, hidden]`` is the
    final norm's output (the lm_head's input, what the MTP head reads), made a graph output here."""
    return _prefill_fn(model_dir, hidden=True)


def _lm_head_input(model: Any) -> str:
    """The value the builder's lm_head MatMul multiplies (the final norm's output)."""
    for node in model.graph.node:
        if node.op_type == "MatMul" and "lm_head" in node.name:
            return str(node.input[0])
    raise ValueError("no lm_head MatMul in the graph; expected an onnxruntime-genai fp32 export")


def _prefill_fn(model_dir: Path, hidden: bool) -> Any:
    import onnx
    import onnxruntime as ort

    head = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    outputs = ["logits"]
    if hidden:
        model = onnx.load(str(model_dir / "model.onnx"))  # with its weights: the session gets bytes
        outputs.append(_lm_head_input(model))
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(outputs[-1]))
        source: Any = model.SerializeToString()
    else:
        source = str(model_dir / "model.onnx")
    sess = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])

    def past_shape(port: Any, batch: int) -> list[int]:
        if port.name.startswith("past_key_values."):
            return [batch, port.shape[1], 0, head]
        return [batch, *port.shape[1:]]

    def run(ids: np.ndarray) -> np.ndarray:
        batch, length = ids.shape
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        feeds["position_ids"] = np.broadcast_to(np.arange(length), (3, batch, length)).astype(np.int64)
        for port in sess.get_inputs():
            if port.name.startswith("past"):
                feeds[port.name] = np.zeros(past_shape(port, batch), dtype=np.float32)
        return sess.run(outputs, feeds)

    return run


def onnx_loss(model_dir: Path, val: np.ndarray, seq_len: int, decode: Any, batch: int = 4) -> Loss:
    """Loss of an ONNX export (plain onnxruntime, one prefill per window) on every validation window."""
    run = prefill_logits_fn(model_dir)
    windows = val_windows(val, seq_len)
    total = 0.0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        logits = run(chunk[:, :-1]).astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logz = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
        picked = np.take_along_axis(logits, chunk[:, 1:, None], axis=-1)[..., 0]
        total += float((logz - picked).sum())
    return Loss(total / windows[:, 1:].size, windows[:, 1:].size, _scored_bytes(windows, decode))


def unigram_loss(train: np.ndarray, val: np.ndarray, seq_len: int, vocab: int, decode: Any) -> Loss:
    """Baseline: each token predicted from the training set's token frequencies (add-one smoothed)."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    windows = val_windows(val, seq_len)
    targets = windows[:, 1:]
    return Loss(float(-logp[targets].mean()), targets.size, _scored_bytes(windows, decode))


@dataclass(frozen=True)
class LookupStats:
    """What prompt lookup would have done while the model generated greedily."""

    generated: int  # tokens the model produced
    verify_steps: int  # target forwards with lookup (each verifies a draft and yields one more token)
    drafted: int
    accepted: int

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.generated / self.verify_steps


def simulate_prompt_lookup(
    prompt: list[int], generated: list[int], max_ngram: int = 3, k: int = 4
) -> LookupStats:
    """Replay a greedy generation through onnxgen's n-gram proposer: at each verify step the proposer
    sees prompt + tokens so far and drafts up to ``k``; drafts are accepted while they equal the
    model's own greedy tokens, then the model adds one token (as speculative greedy decoding does)."""
    from onnxgen.generation.speculative.proposers import NgramProposer

    proposer = NgramProposer(max_ngram=max_ngram)
    full = np.asarray(prompt + generated, dtype=np.int64)
    pos, steps, drafted, accepted = len(prompt), 0, 0, 0
    while pos < len(full):
        draft, _ = proposer.propose(full[:pos], k)
        draft = draft[: len(full) - pos - 1]  # the last token is always the model's own
        ok = 0
        while ok < len(draft) and draft[ok] == full[pos + ok]:
            ok += 1
        drafted, accepted, steps = drafted + len(draft), accepted + ok, steps + 1
        pos += ok + 1
    return LookupStats(len(generated), steps, drafted, accepted)


def genai_greedy(model_dir: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens from onnxruntime-genai itself, for the cross-check: up to ``new_tokens``, ending at an
    end-of-sequence token like onnxgen's (no ``min_length``: onnxruntime-genai meets one by masking the
    end-of-sequence logits, which would choose another token where the model chooses to end)."""
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + new_tokens)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array(prompt, dtype=np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)][len(prompt) :]


def repeated_ngrams(ids: list[int], n: int = 4) -> float:
    """Share of n-grams in ``ids`` that occur more than once (a crude degeneration measure)."""
    grams = Counter(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))
    total = sum(grams.values())
    return sum(c for c in grams.values() if c > 1) / total if total else 0.0


def repeated_span_nll(
    model_dir: Path, val: np.ndarray, span: int = 64, count: int = 16
) -> tuple[float, float]:
    """Mean loss on held-out spans the first time and the second time they appear: each input is a
    validation span of ``span`` tokens written twice. A model that copies predicts the repeat almost
    exactly (second number near 0); one that does not scores both alike."""
    run = prefill_logits_fn(model_dir)
    starts = np.linspace(0, val.size - span - 1, count).astype(int)
    ids = np.stack([np.concatenate([val[s : s + span]] * 2) for s in starts]).astype(np.int64)
    logits = run(ids).astype(np.float64)[:, :-1]
    top = logits.max(-1, keepdims=True)
    logz = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    nll = logz - np.take_along_axis(logits, ids[:, 1:, None], axis=-1)[..., 0]
    return float(nll[:, : span - 1].mean()), float(nll[:, span:].mean())


def copy_accuracy(model_dir: Path, spans: np.ndarray) -> float:
    """Teacher-forced next-token accuracy (argmax) on the second copy of each span of ``spans``
    ``[count, span]``, written twice: how often the model continues a repeat correctly once it has seen
    the repeat's first token."""
    run = prefill_logits_fn(model_dir)
    span = spans.shape[1]
    ids = np.concatenate([spans, spans], axis=1).astype(np.int64)
    predicted = run(ids).argmax(-1)[:, span : 2 * span - 1]
    return float((predicted == spans[:, 1:]).mean())


def copy_probe_spans(
    val: np.ndarray, id_range: tuple[int, int], span: int = 48, count: int = 16, seed: int = 99
) -> dict[str, np.ndarray]:
    """Spans for :func:`copy_accuracy`: held-out text at evenly spaced places, and random ids."""
    starts = np.linspace(0, val.size - span - 1, count).astype(int)
    rng = np.random.default_rng(seed)
    return {
        "held-out text": np.stack([val[s : s + span] for s in starts]).astype(np.int64),
        "random ids": rng.integers(id_range[0], id_range[1], size=(count, span)),
    }


def copied_prefix(generated: str, source: str) -> int:
    """How many leading characters of ``generated`` equal ``source``."""
    n = 0
    for a, b in zip(generated, source, strict=False):
        if a != b:
            break
        n += 1
    return n


@dataclass(frozen=True)
class MTPStats:
    """What MTP speculation with ``k`` chained drafts would have done while the model generated greedily."""

    k: int
    generated: int
    verify_steps: int
    drafted: tuple[int, ...]  # per draft position (1st, 2nd, ...): drafts made there
    accepted: tuple[int, ...]  # per draft position: drafts accepted there

    @property
    def tokens_per_step(self) -> float:
        return self.generated / self.verify_steps


def simulate_mtp(head: Any, full: list[int], prompt_len: int, hidden: np.ndarray, k: int) -> MTPStats:
    """Replay a greedy generation (``full`` = prompt + generated ids; ``hidden [len(full), hidden]`` the
    model's final hidden states over it) through MTP speculation with ``k`` chained drafts, as
    :func:`simulate_prompt_lookup` does for prompt lookup: at each verify step, with ``full[:pos]``
    known, the head drafts ``full[pos]`` from the model's hidden state at ``pos - 2`` and token
    ``full[pos - 1]``, then chains from its own hidden state and draft (its KV cache holding the rows of
    every earlier position); drafts are accepted while they equal the model's tokens, then the model
    adds one. ``head(hidden, next_ids, start, past) -> (logits, head_hidden, kv)`` is the head's forward
    (:func:`tools.demo_model.mtp.mtp_reference` with the weights bound)."""
    import torch

    ids = torch.tensor([full])
    states = torch.from_numpy(np.ascontiguousarray(hidden[None]))
    logits, head_states, (keys, values) = head(states[:, :-1], ids[:, 1:], 0, None)
    first = logits[0].argmax(-1).tolist()  # row j: the draft of full[j + 2]
    pos, steps = prompt_len, 0
    drafted, accepted = [0] * k, [0] * k
    while pos < len(full):
        drafts, state = [first[pos - 2]], head_states[:, pos - 2 : pos - 1]
        past = (keys[:, :, : pos - 1], values[:, :, : pos - 1])
        while len(drafts) < min(k, len(full) - pos - 1):
            step_logits, state, past = head(state, torch.tensor([[drafts[-1]]]), pos - 2 + len(drafts), past)
            drafts.append(int(step_logits[0, -1].argmax()))
        drafts = drafts[: len(full) - pos - 1]  # the last token is always the model's own
        ok = 0
        while ok < len(drafts) and drafts[ok] == full[pos + ok]:
            ok += 1
        for i in range(len(drafts)):
            drafted[i] += 1
            accepted[i] += int(i < ok)
        pos, steps = pos + ok + 1, steps + 1
    return MTPStats(k, len(full) - prompt_len, steps, tuple(drafted), tuple(accepted))


def mtp_agreement(
    head: Any, model_dir: Path, val: np.ndarray, seq_len: int, batch: int = 4
) -> dict[str, float]:
    """Teacher-forced over every held-out window, on the ONNX export's hidden states: the share of
    positions where the head's argmax equals the export's own greedy token after next (the acceptance of
    a first draft under greedy decoding), and where it equals the text's token after next."""
    import torch

    run = prefill_hidden_fn(model_dir)
    windows = val_windows(val, seq_len)
    count, agree, correct = 0, 0, 0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        logits, hidden = run(chunk[:, :-1])
        greedy = logits.argmax(-1)  # [b, t]: the export's token t + 1 at each t
        ids = torch.from_numpy(chunk[:, :-1])
        with torch.no_grad():
            drafts = head(torch.from_numpy(hidden[:, :-1]), ids[:, 1:], 0, None)[0].argmax(-1).numpy()
        agree += int((drafts == greedy[:, 1:]).sum())
        correct += int((drafts == chunk[:, 2:]).sum())
        count += drafts.size
    return {"positions": count, "agreement": agree / count, "accuracy": correct / count}


def bundled_head(model_dir: Path) -> Any:
    """The MTP head of a model directory laid out as the bundled default model (``config.json``,
    ``mtp.safetensors``, and the export's ``lm_head`` weight as the shared embedding), as the callable
    :func:`simulate_mtp` and :func:`mtp_agreement` take."""
    import onnx
    import torch
    from onnx import numpy_helper
    from safetensors.torch import load_file

    from tools.demo_model.mtp import mtp_reference

    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    weights = load_file(str(model_dir / "mtp.safetensors"))
    graph = onnx.load(str(model_dir / "model.onnx")).graph
    lm_head = next(t for t in graph.initializer if t.name == "lm_head.MatMul.weight")
    embed = torch.from_numpy(numpy_helper.to_array(lm_head).T.copy())

    def head(hidden: Any, next_ids: Any, start: int, past: Any) -> Any:
        with torch.no_grad():
            return mtp_reference(weights, text, embed, hidden, next_ids, start, past)

    return head
