"""Helpers of the speculative-decoding tests: a lazily built model zoo, reference runs, statistics."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

import onnxgen
from onnxgen import GenerationResult, SamplingParams
from onnxgen.llm import LLM
from onnxgen.runtime.session import DecoderSession
from onnxgen.runtime.state import DecodeState
from onnxgen.testing import TinySpec, build_model

DENSE_FAMILIES = ("genai-dense", "standard-dense")
HYBRID_FAMILIES = ("hybrid-genai", "hybrid-mobius", "hybrid-scan")
FAMILIES = DENSE_FAMILIES + HYBRID_FAMILIES
PROMPT = [5, 17, 200, 33, 44, 91, 12, 8]
# A near-tie: plain greedy and a multi-token verify may round the top-2 logits in either order.
NEAR_TIE = 1e-4

# The weaker draft of each family: the int4 (MatMulNBits) export of the same spec. The plain-ONNX
# families cannot hold int4, so they are drafted by the int4 export of the family that computes the
# same function (genai-dense for standard-dense, hybrid-mobius for hybrid-scan).
WEAK_DRAFT = {
    "genai-dense": "genai-dense",
    "standard-dense": "genai-dense",
    "hybrid-genai": "hybrid-genai",
    "hybrid-mobius": "hybrid-mobius",
    "hybrid-scan": "hybrid-mobius",
}


def default_spec(family: str) -> TinySpec:
    return TinySpec.hybrid() if family.startswith("hybrid") else TinySpec()


class ModelZoo:
    """Model directories and one-thread LLMs, built on first request and cached for the session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dirs: dict[tuple[str, str, TinySpec], Path] = {}
        self._llms: dict[tuple[str, str, TinySpec], LLM] = {}

    def dir(self, family: str, precision: str = "fp32", spec: TinySpec | None = None) -> Path:
        key = (family, precision, spec or default_spec(family))
        if key not in self._dirs:
            name = f"{family}-{precision}-{len(self._dirs)}"
            self._dirs[key] = build_model(self.root / name, family, key[2], precision=precision)
        return self._dirs[key]

    def llm(self, family: str, precision: str = "fp32", spec: TinySpec | None = None) -> LLM:
        key = (family, precision, spec or default_spec(family))
        if key not in self._llms:
            self._llms[key] = onnxgen.load(self.dir(family, precision, spec), threads=1)
        return self._llms[key]


def ids(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray([list(tokens)], dtype=np.int64)


def greedy(llm: LLM, prompt: Sequence[int], n: int, **params: object) -> GenerationResult:
    return llm.generate(list(prompt), SamplingParams(max_new_tokens=n, **params))  # type: ignore[arg-type]


def repeating_prompt(llm: LLM, base: Sequence[int] = PROMPT, n: int = 16, repeat: int = 6) -> list[int]:
    """``base + out + base + out[:repeat]`` with ``out`` the model's own greedy continuation of ``base``:
    the tiny random models tend to continue it with ``out[repeat:]``, which prompt lookup can propose."""
    out = greedy(llm, base, n).token_ids
    return [*base, *out, *base, *out[:repeat]]


def plain_step_logits(session: DecoderSession, prompt: Sequence[int], fed: Sequence[int]) -> np.ndarray:
    """The logits plain decoding sees after ``prompt`` and then after each token of ``fed``, fed exactly as
    plain decoding feeds them (one prefill forward keeping the last row, then one-token steps).

    Row i (of ``len(fed) + 1``) predicts the token after ``prompt + fed[:i]``.
    """
    state = session.new_state(len(prompt) + len(fed) + 1)
    rows = [session.forward(state, ids(prompt), 1)[0, -1]]
    rows += [session.forward(state, ids([t]), 1)[0, -1] for t in fed]
    return np.stack(rows)


def top2_margin(row: np.ndarray) -> float:
    top = np.sort(row.astype(np.float64))[-2:]
    return float(top[1] - top[0])


def assert_same_as_plain(
    session: DecoderSession, prompt: Sequence[int], plain: Sequence[int], speculative: Sequence[int]
) -> None:
    """Speculative greedy must emit plain greedy's tokens. The one excuse is a near-tie: at the first
    differing token, the plain run's top-2 logits must be within ``NEAR_TIE`` and the speculative token
    must be the runner-up; such a flip is reported as a warning, never passed silently."""
    plain, speculative = list(plain), list(speculative)
    if plain == speculative:
        return
    m = next((i for i, (a, b) in enumerate(zip(plain, speculative, strict=False)) if a != b), None)
    assert m is not None, (
        f"same tokens but different lengths: plain {len(plain)}, speculative {len(speculative)}"
    )
    row = plain_step_logits(session, prompt, plain[:m])[m]
    margin = top2_margin(row)
    runner_up = int(np.argsort(row)[-2])
    assert margin < NEAR_TIE and speculative[m] == runner_up, (
        f"speculative greedy emitted {speculative[m]} at token {m} where plain greedy emitted {plain[m]}; "
        f"the plain run's top-2 logit margin there is {margin:.3g} (runner-up {runner_up}), not a near-tie"
    )
    warnings.warn(
        f"near-tie flip at token {m}: plain {plain[m]} vs speculative {speculative[m]}, top-2 margin "
        f"{margin:.3g} < {NEAR_TIE}; tokens after it are not compared",
        stacklevel=2,
    )


def assert_stats_consistent(result: GenerationResult, *, hybrid: bool) -> None:
    """The speculative counters agree with each other and with the tokens emitted.

    Every target forward that is not a state replay emits one token plus the drafts it accepted, so
    a run that ended on its length limit has generated = forwards - replays + accepted (accepted counts
    verify outcomes: drafts accepted after an eos or stop string that ended the run count too).
    """
    s = result.stats
    proposed, accepted = s["proposed_draft_tokens"], s["accepted_draft_tokens"]
    passes, replays = s["target_forward_passes"], s["state_replays"]
    assert 0 <= accepted <= proposed
    assert s["forward_passes"] == passes
    assert s["generated_tokens"] == len(result.token_ids)
    if not hybrid:
        assert replays == 0, "a dense model rewinds its KV cache; it never replays"
    if result.finish_reason == "length":
        assert s["generated_tokens"] == passes - replays + accepted
    else:  # an eos or stop string can end generation before the rest of a verify's tokens
        assert s["generated_tokens"] <= passes - replays + accepted
    if accepted > 0:
        assert passes < s["generated_tokens"]


def spread_sampling(seed: int, length: int) -> SamplingParams:
    """Sampling with temperature, top-k, top-p and a presence penalty, ``length`` tokens every run: what
    the distribution tests draw with (a spread-out distribution small enough to enumerate)."""
    return SamplingParams(
        max_new_tokens=length,
        temperature=1.3,
        top_k=4,
        top_p=0.9,
        presence_penalty=0.5,
        ignore_eos=True,  # every run is ``length`` tokens long
        seed=seed,
    )


# -- chi-square ---------------------------------------------------------------------------------------
# scipy is not a dependency. The critical value uses the Wilson-Hilferty approximation of the
# chi-square quantile, accurate to about 1% for df >= 3 (more than good enough at alpha = 1e-3).
Z_999 = 3.090232  # standard normal quantile at 1 - 1e-3


def chi2_critical(df: int, z: float = Z_999) -> float:
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2_statistic(counts: dict[object, int], expected_p: dict[object, float], n: int) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` (n draws) against ``expected_p``, and its degrees of freedom.

    Cells expected fewer than 5 times are pooled into one cell (the usual validity rule); a draw
    outside the support of ``expected_p`` lands in the pooled cell, whose expectation is then tiny,
    so such a draw fails the test loudly.
    """
    big = {c: p for c, p in expected_p.items() if p * n >= 5.0}
    pooled_p = max(1.0 - sum(big.values()), 0.0)
    observed = [counts.get(c, 0) for c in big]
    pooled_count = n - sum(observed)
    cells = [(o, p * n) for o, p in zip(observed, big.values(), strict=True)]
    if pooled_count or pooled_p * n > 0:
        cells.append((pooled_count, max(pooled_p * n, 1e-9)))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return stat, len(cells) - 1


def plain_distribution(
    session: DecoderSession,
    prompt: Sequence[int],
    params: SamplingParams,
    eos_ids: Sequence[int],
    length: int,
) -> dict[tuple[int, ...], float]:
    """The exact probability of every sequence of ``length`` tokens under plain sampling: the chain of
    processors (penalties, temperature, top-k, top-p) applied per step to that step's prefix, then
    softmax; enumerated over the (top-k limited) support."""
    from onnxgen.generation.processors import SequenceView, apply_chain, build_chain
    from onnxgen.generation.sampling import probs

    chain = build_chain(params, eos_ids)
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], mass: float) -> None:
        if len(prefix) == length:
            out[tuple(prefix)] = mass
            return
        seq = [*prompt, *prefix]
        logits = plain_step_logits(session, prompt, prefix)[-1]
        p = probs(apply_chain(chain, SequenceView(np.asarray(seq), len(prompt)), logits))
        for token in np.flatnonzero(p):
            walk([*prefix, int(token)], mass * float(p[token]))

    walk([], 1.0)
    return out


def fresh_state(session: DecoderSession, groups: Sequence[Sequence[int]], capacity: int = 64) -> DecodeState:
    """A new state fed ``groups`` of tokens, one forward per group."""
    state = session.new_state(capacity)
    for group in groups:
        session.forward(state, ids(group))
    return state


def mismatches(a: dict[str, np.ndarray], b: dict[str, np.ndarray], atol: float = 0.0) -> Iterator[str]:
    """Names (with how they differ) of the arrays that are not equal, or not within ``atol`` when given."""
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b:
            yield f"{name}: missing on one side"
        elif a[name].shape != b[name].shape:
            yield f"{name}: shape {a[name].shape} vs {b[name].shape}"
        elif not (np.array_equal(a[name], b[name]) if atol == 0 else np.allclose(a[name], b[name], 0, atol)):
            yield f"{name}: max |diff| {np.abs(a[name] - b[name]).max():.3g}"


class NoisyOracle:
    """Drafts plain greedy's own next tokens, replacing each with a wrong one with probability ``p``
    (seeded), so that verifies accept every prefix length from none to all."""

    def __init__(self, reference: list[int], p: float, vocab: int, seed: int = 0) -> None:
        self.reference, self.p, self.vocab = reference, p, vocab
        self.rng = np.random.default_rng(seed)

    def propose(self, ids: np.ndarray, k: int) -> tuple[list[int], None]:
        n = len(ids)
        drafts = self.reference[n : n + k]
        return [t if self.rng.random() >= self.p else (t + 1) % self.vocab for t in drafts], None

    def observe(self, context_len: int, accepted: int) -> None:
        pass

    def reset(self, prompt_len: int) -> None:
        pass
