"""The MTP head session's forwards: a chain of single-entry forwards (how the proposer drafts) gives what one
forward over the same entries gives, keeps no decode lane (a lane cannot carry the hidden-state feed), and
refuses ids outside the vocabulary before running, on the few-token path as on the long one."""

from __future__ import annotations

import numpy as np
import pytest
from mtp_helpers import MTPZoo

from onnxgen.errors import GenerationError
from onnxgen.runtime.mtp_head import MTPHeadSession
from onnxgen.runtime.state import DecodeState

TOKENS = [3, 99, 250, 7, 11, 42, 5, 8, 120, 64]
TOLERANCE = 1e-5  # one forward against a chain groups the float sums differently
FIRST = 4  # the chain's first forward takes this many entries (a proposal's catch-up), then one at a time


def entries(head: MTPHeadSession, n: int) -> np.ndarray:
    """Seeded stand-ins for the target's hidden states, ``[1, n, hidden]``."""
    return np.random.default_rng(0).standard_normal((1, n, head.hidden_size)).astype(np.float32)


def chain(
    head: MTPHeadSession, state: DecodeState, hidden: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The catch-up forward over the first ``FIRST`` entries, then one forward per entry; the outputs of
    each, and the state's lanes checked empty after each."""
    outputs = [head.forward(state, np.array([TOKENS[:FIRST]]), hidden[:, :FIRST])]
    assert state.bindings.lanes == [None, None]
    for i in range(FIRST, len(TOKENS)):
        outputs.append(head.forward(state, np.array([[TOKENS[i]]]), hidden[:, i : i + 1]))
        assert state.bindings.lanes == [None, None]
    return outputs


@pytest.mark.parametrize("family", ["genai-dense", "hybrid-genai"])
def test_chained_head_forwards_give_a_whole_forwards_outputs_and_keep_no_lane(
    mtp_zoo: MTPZoo, family: str
) -> None:
    head = mtp_zoo.llm(family).mtp_head()
    hidden = entries(head, len(TOKENS))
    got = chain(head, head.new_state(64), hidden)
    for i, (logits, out) in enumerate(got):
        n = FIRST + i  # entries the chain had read
        reference = head.forward(head.new_state(64), np.array([TOKENS[:n]]), hidden[:, :n])
        np.testing.assert_allclose(logits, reference[0], atol=TOLERANCE)
        np.testing.assert_allclose(out, reference[1], atol=TOLERANCE)
    # negative control: one entry's hidden state changed mid-chain; every output from it on moves by more
    # than the tolerance, the later ones through the head's cache alone
    off = hidden.copy()
    off[0, FIRST + 1] += 5.0
    moved = chain(head, head.new_state(64), off)
    for (logits, _), (bad, _) in zip(got[2:], moved[2:], strict=True):
        assert np.abs(logits - bad).max() > 10 * TOLERANCE


@pytest.mark.parametrize("count", [1, 3, 40])
def test_head_ids_outside_the_vocabulary_are_refused_before_running(mtp_zoo: MTPZoo, count: int) -> None:
    head = mtp_zoo.llm("genai-dense").mtp_head()
    state = head.new_state(64)
    head.forward(state, np.array([TOKENS[:2]]), entries(head, 2))
    for bad in (head.vocab_size, -1):
        tokens = np.full((1, count), 5, dtype=np.int64)
        tokens[0, -1] = bad
        with pytest.raises(GenerationError, match=rf"\[{bad}\].*outside the model's vocabulary"):
            head.forward(state, tokens, entries(head, count))
        assert state.length == 2  # nothing ran
    # the largest id is in
    head.forward(state, np.full((1, count), head.vocab_size - 1, dtype=np.int64), entries(head, count))
    assert state.length == 2 + count
