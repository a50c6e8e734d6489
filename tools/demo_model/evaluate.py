"""Score a training checkpoint, or a builder fp32 export, on the demo model's targets without exporting it.

``python -m tools.demo_model.evaluate PATH [--data RUN]``: ``PATH`` is a checkpoint of a run
(``RUN/train/last.pt`` or ``RUN/train/step-N.pt``) or an export directory (the bundled folder, for the
baseline); the held-out stream and tokenizer come from ``RUN/data`` and ``RUN/tokenizer`` (``--data RUN``
for an export). Prints one JSON object:

- ``val_loss`` / ``val_ppl``: mean cross-entropy over every held-out window of ``seq_len`` (the number
  docs/demo-model.md's held-out table reports; the training log's ``val_loss`` scores the first
  ``eval_windows`` windows only, which read higher);
- ``greedy``: the greedy continuation (torch, no cache) of each prompt, and ``loop``: where its tokens
  first fall into a block repeated back to back (see :func:`loop_at`), null when they do not;
- ``copy_accuracy``: teacher-forced next-token accuracy over the second copy of spans written twice
  (:func:`tools.demo_model.measure.copy_probe_spans`), what prompt lookup and MTP drafting lean on;
- ``loop_share``: the share of greedy continuations (64 tokens, up to a stop id) of 48 held-out prefixes
  (12 each of 4, 8, 16 and 32 tokens, at seeded places) that fall into a loop (:func:`loop_at`): how
  often the model loops in general, beside the three prompts above.

A step-N checkpoint of a ``wsd`` run is taken at its constant rate: a cooldown branched from it
(``train --resume RUN/train/step-N.pt --out DIR --steps M``) scores better than the checkpoint itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tools.demo_model.config import STOP_IDS, DemoConfig
from tools.demo_model.tokenizer import FIRST_ORDINARY_ID

PROMPTS = ("def fibonacci(n):", "import os", "class Stack:")  # docs/demo-model.md's greedy completions
LOOP_PREFIXES = (4, 8, 16, 32)  # prefix lengths of loop_share's held-out prompts, LOOP_ROWS of each
LOOP_ROWS = 12
LOOP_SEED = 1234


def loop_at(ids: Sequence[int], min_tokens: int = 12, min_repeats: int = 3) -> tuple[int, int] | None:
    """``(start, period)`` of the first place where a block of ``period`` tokens repeats back to back at
    least ``min_repeats`` times and over at least ``min_tokens`` tokens (``" string"`` twelve times, a
    clause four times), or None. Short legitimate repeats (``i += 1`` twice) do not count."""
    n = len(ids)
    for start in range(n):
        for period in range(1, (n - start) // min_repeats + 1):
            span = max(min_repeats * period, min_tokens)
            if start + span > n:
                continue
            if all(ids[start + k] == ids[start + k - period] for k in range(period, span)):
                return start, period
    return None


def looping_share(continuations: Sequence[Sequence[int]]) -> float:
    """The share of ``continuations`` with a loop (:func:`loop_at`) before their first stop id (what
    follows a stop is never shown)."""
    looped = 0
    for row in continuations:
        stop = next((i for i, t in enumerate(row) if t in STOP_IDS), len(row))
        looped += loop_at(list(row[:stop])) is not None
    return looped / len(continuations)


def loop_share(lm: Any, val: np.ndarray, new_tokens: int = 64) -> float:
    """:func:`looping_share` of the greedy continuations of ``LOOP_ROWS`` held-out prefixes of each length
    in ``LOOP_PREFIXES``, taken at seeded places of ``val`` (the same prompts for every checkpoint)."""
    import torch

    from tools.demo_model.unlikelihood import continue_batch

    rng = np.random.default_rng(LOOP_SEED)
    rows: list[list[int]] = []
    for length in LOOP_PREFIXES:
        starts = rng.integers(0, val.size - length, size=LOOP_ROWS)
        prefixes = torch.from_numpy(np.stack([val[s : s + length] for s in starts]).astype(np.int64))
        rows += continue_batch(lm, prefixes, new_tokens).tolist()
    return looping_share(rows)


def load_checkpoint(path: Path) -> tuple[Any, DemoConfig]:
    """The causal LM of a training checkpoint, and the config it was trained with."""
    import torch

    from tools.demo_model.model import DemoModel

    state = torch.load(path, weights_only=False, map_location="cpu")
    config = DemoConfig(**state["config"])
    model = DemoModel(config)
    model.load_state_dict(state["model"])
    return model.lm.eval(), config


def load_export(export_dir: Path, train_ids: np.ndarray) -> tuple[Any, DemoConfig]:
    """The causal LM read back from a builder fp32 export of a demo model (its geometry from its
    ``config.json``)."""
    from tools.demo_model.trainer import new_model
    from tools.demo_model.warmstart import init_from_export

    text = json.loads((export_dir / "config.json").read_text())["text_config"]
    config = dataclasses.replace(
        DemoConfig(),
        hidden=text["hidden_size"],
        intermediate=text["intermediate_size"],
        layers=text["num_hidden_layers"],
        mtp_weight=0.0,
    )
    model = new_model(config)
    init_from_export(model, config, export_dir, train_ids)
    return model.lm.eval(), config


def greedy(lm: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation of ``prompt`` (full forward per token: no cache to get wrong), stopping after a
    stop id."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = lm(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
            if ids[-1] in STOP_IDS:
                break
    return ids[len(prompt) :]


def copy_accuracy(lm: Any, spans: np.ndarray) -> float:
    """:func:`tools.demo_model.measure.copy_accuracy` on the torch model."""
    import torch

    span = spans.shape[1]
    ids = torch.from_numpy(np.concatenate([spans, spans], axis=1).astype(np.int64))
    with torch.no_grad():
        predicted = lm(input_ids=ids).logits.argmax(-1)[:, span : 2 * span - 1].numpy()
    return float((predicted == spans[:, 1:]).mean())


def score(lm: Any, config: DemoConfig, run: Path, new_tokens: int = 64) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from tools.demo_model.gdn import fast_gated_delta_rule
    from tools.demo_model.measure import copy_probe_spans
    from tools.demo_model.trainer import evaluate

    val = np.load(run / "data" / "val.npy")
    tok = Tokenizer.from_file(str(run / "tokenizer" / "tokenizer.json"))
    with fast_gated_delta_rule():
        loss = evaluate(lm, val, config.seq_len, None)
        looping = loop_share(lm, val)
    samples = {}
    for prompt in PROMPTS:
        out = greedy(lm, tok.encode(prompt, add_special_tokens=False).ids, new_tokens)
        found = loop_at(out)
        samples[prompt] = {
            "text": tok.decode(out),
            "loop": None if found is None else {"token": found[0], "period": found[1]},
        }
    spans = copy_probe_spans(val, (FIRST_ORDINARY_ID, config.vocab_size))
    return {
        "val_loss": round(loss, 4),
        "val_ppl": round(math.exp(loss), 2),
        "greedy": samples,
        "copy_accuracy": {name: round(copy_accuracy(lm, s), 3) for name, s in spans.items()},
        "loop_share": round(looping, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.demo_model.evaluate", description=__doc__.splitlines()[0]
    )
    p.add_argument("path", type=Path, help="a checkpoint (RUN/train/*.pt) or a builder fp32 export directory")
    p.add_argument(
        "--data", type=Path, help="the run whose data/ and tokenizer/ to use (default: the checkpoint's)"
    )
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    path = args.path.resolve()
    if path.is_dir():
        if args.data is None:
            p.error("an export directory needs --data RUN (a run directory with data/ and tokenizer/)")
        run = args.data.resolve()
        lm, config = load_export(path, np.load(run / "data" / "train.npy"))
        step = None
    else:
        run = args.data.resolve() if args.data else path.parent.parent
        lm, config = load_checkpoint(path)
        step = int(torch.load(path, weights_only=False, map_location="cpu")["step"])
    print(json.dumps({"path": str(path), "step": step, **score(lm, config, run, args.new_tokens)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
