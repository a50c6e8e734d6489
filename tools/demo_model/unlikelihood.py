"""Sequence-level unlikelihood training (Welleck et al. 2019, "Neural Text Generation with Unlikelihood
Training"): the stage that teaches the demo model not to fall into greedy loops.

Lower perplexity alone does not stop a small model's greedy output from repeating itself: the loop is a
property of the model's own continuations, which maximum likelihood on text never sees. So each step of
the stage (``unlikelihood_steps`` after the copy phase, :meth:`DemoConfig.unlikelihood_at`):

1. draws ``ul_prefixes`` training-text prefixes of one length (``ul_min_prefix`` .. ``ul_prefix``) from
   ``(seed, step)`` alone (:func:`prefixes_at`);
2. continues them with the current weights, ``ul_new_tokens`` tokens each, greedy (or top-k sampled from a
   generator seeded by ``(seed, step)``), batched, without gradient (:func:`continue_batch`);
3. marks the continuation tokens that repeat (:func:`repetition_marks`): a token that completes an
   ``ul_ngram``-gram already seen earlier in that continuation, or the ``ul_run``-th token of one token
   repeated back to back. Only the continuation counts: text copied from the prefix is not a repeat;
4. adds ``ul_weight`` times the mean over the continuation tokens of ``-log(1 - p(token))`` at the
   marked ones (:func:`unlikelihood_loss`) to the MLE loss of the step's usual main-mix batch, whose
   copy rows keep training the copying of a prompt.

Everything depends on the config, the weights and ``(seed, step)``, so the stage resumes bit for bit like
the rest of the trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tools.demo_model.config import STOP_IDS, DemoConfig


def repetition_marks(ids: Sequence[int], ngram: int, run: int = 0) -> np.ndarray:
    """Per token of a continuation ``ids``, whether it repeats: it completes an ``ngram``-gram that already
    occurred earlier in ``ids`` (an earlier occurrence may overlap it: ``a a a a a`` marks the fifth
    ``a`` at ``ngram=4``), or it is the ``run``-th or a later token of one token repeated back to back
    (``run=0``: no such rule). First occurrences are never marked."""
    tokens = [int(t) for t in ids]
    marks = np.zeros(len(tokens), dtype=bool)
    seen: set[tuple[int, ...]] = set()
    for t in range(ngram - 1, len(tokens)):
        gram = tuple(tokens[t - ngram + 1 : t + 1])
        marks[t] = gram in seen
        seen.add(gram)
    if run >= 2:
        length = 1
        for t in range(1, len(tokens)):
            length = length + 1 if tokens[t] == tokens[t - 1] else 1
            marks[t] |= length >= run
    return marks


def prefixes_at(stream: np.ndarray, step: int, config: DemoConfig) -> np.ndarray:
    """Step ``step``'s ``[ul_prefixes, n]`` prefixes: windows of ``stream`` at places drawn from
    ``(seed, step)`` alone, all of one length ``n`` (``ul_min_prefix`` .. ``ul_prefix``, drawn too: short
    prompts like the README's loop most)."""
    rng = np.random.default_rng([config.seed, step, 3])
    n = int(rng.integers(config.ul_min_prefix, config.ul_prefix + 1))
    starts = rng.integers(0, stream.size - n, size=config.ul_prefixes)
    return np.stack([stream[s : s + n] for s in starts]).astype(np.int64)


def continue_batch(lm: Any, prefixes: Any, new_tokens: int, top_k: int = 1, generator: Any = None) -> Any:
    """``[b, new_tokens]`` continuations of ``prefixes [b, n]`` (a torch int64 tensor) by a transformers
    causal LM: one prefill, then a token at a time from its cache; each token is the argmax (``top_k`` 1)
    or drawn from the ``top_k`` most likely with ``generator``. No gradient; runs past stop ids (the loss
    ignores what follows one)."""
    import torch

    out = []
    with torch.no_grad():
        step = lm(input_ids=prefixes, use_cache=True)
        for i in range(new_tokens):
            logits = step.logits[:, -1]
            if top_k <= 1:
                chosen = logits.argmax(-1)
            else:
                top = logits.topk(top_k, -1)
                pick = torch.multinomial(top.values.softmax(-1), 1, generator=generator)
                chosen = top.indices.gather(-1, pick).squeeze(-1)
            out.append(chosen)
            if i + 1 < new_tokens:
                step = lm(input_ids=chosen[:, None], cache=step.cache, use_cache=True)
    return torch.stack(out, 1)


@dataclass(frozen=True)
class Continuations:
    """``rows [b, n + new]``: prefixes and their continuations; ``marks`` / ``scored`` ``[b, new]``: the
    repeated continuation tokens, and the tokens up to and including a row's first stop id."""

    rows: Any
    prefix_len: int
    marks: Any
    scored: Any


def continuations_at(lm: Any, stream: np.ndarray, step: int, config: DemoConfig) -> Continuations:
    """Step ``step``'s continuations of :func:`prefixes_at` by the current weights, with their marks."""
    import torch

    prefixes = torch.from_numpy(prefixes_at(stream, step, config))
    generator = torch.Generator().manual_seed(
        int(np.random.default_rng([config.seed, step, 4]).integers(2**62))
    )
    new = continue_batch(lm, prefixes, config.ul_new_tokens, config.ul_top_k, generator)
    scored = np.ones(tuple(new.shape), dtype=bool)
    marks = np.zeros_like(scored)
    for r, row in enumerate(new.tolist()):
        stop = next((i for i, t in enumerate(row) if t in STOP_IDS), len(row) - 1)
        scored[r, stop + 1 :] = False
        marks[r, : stop + 1] = repetition_marks(row[: stop + 1], config.ul_ngram, config.ul_run)
    return Continuations(
        torch.cat([prefixes, new], 1), prefixes.shape[1], torch.from_numpy(marks), torch.from_numpy(scored)
    )


def unlikelihood_loss(lm: Any, batch: Continuations) -> Any:
    """Sum over the marked continuation tokens of ``-log(1 - p(token))`` (``p`` the model's probability of
    it after the tokens before it), divided by the number of scored continuation tokens; differentiable."""

    logits = lm(input_ids=batch.rows[:, :-1]).logits[:, batch.prefix_len - 1 :].float()
    chosen = batch.rows[:, batch.prefix_len :, None]
    # -log(1 - p) = log(sum of all exp(logits)) - log(sum of the others'): finite, with a gradient, even
    # where p rounds to 1 (the confident loops this stage exists for)
    others = logits.scatter(-1, chosen, float("-inf")).logsumexp(-1)
    penalty = logits.logsumexp(-1) - others
    return (penalty * batch.marks).sum() / batch.scored.sum().clamp(min=1)
