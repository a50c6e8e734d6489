"""Models built from one spec in different export families decode alike through DecoderSession.forward."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_helpers import DENSE_FAMILIES, HYBRID_FAMILIES, PROMPT, greedy_run, spec_of

from onnxgen.runtime.session import DecoderSession
from onnxgen.testing import make_weights
from onnxgen.testing.reference import reference_logits

STEPS = 16
ATOL = 1e-4


@pytest.fixture(scope="module")
def runs(sessions: dict[str, DecoderSession]) -> dict[str, tuple[list[int], np.ndarray]]:
    """Per family: greedy tokens and the logits of the prefill plus every decode step."""
    out = {}
    for family, session in sessions.items():
        out[family] = greedy_run(session, session.new_state(64), PROMPT, STEPS)
    return out


@pytest.mark.parametrize("families", [DENSE_FAMILIES, HYBRID_FAMILIES], ids=["dense", "hybrid"])
def test_families_built_from_one_spec_decode_the_same_greedy_tokens(
    runs: dict[str, tuple[list[int], np.ndarray]], families: tuple[str, ...]
) -> None:
    first, *others = families
    for family in others:
        assert runs[family][0] == runs[first][0], f"{family} and {first} diverge"


@pytest.mark.parametrize("families", [DENSE_FAMILIES, HYBRID_FAMILIES], ids=["dense", "hybrid"])
def test_families_built_from_one_spec_give_logits_within_1e_4_at_every_step(
    runs: dict[str, tuple[list[int], np.ndarray]], families: tuple[str, ...]
) -> None:
    first, *others = families
    assert runs[first][1].shape == (STEPS + 1, spec_of(first).vocab_size)
    for family in others:
        np.testing.assert_allclose(runs[family][1], runs[first][1], atol=ATOL, rtol=0, err_msg=family)


def test_the_greedy_runs_do_not_repeat_one_token(runs: dict[str, tuple[list[int], np.ndarray]]) -> None:
    # Parity over a constant sequence would prove little: the fixtures must produce varied tokens.
    for family, (tokens, _) in runs.items():
        assert len(set(tokens)) >= 4, family


@pytest.mark.parametrize("family", DENSE_FAMILIES + HYBRID_FAMILIES)
def test_every_step_matches_the_numpy_reference_over_the_whole_sequence(
    runs: dict[str, tuple[list[int], np.ndarray]], family: str
) -> None:
    tokens, logits = runs[family]
    spec = spec_of(family)
    ref = reference_logits(spec, make_weights(spec), PROMPT + tokens)
    # Step i's logits predict token i: reference rows len(PROMPT)-1 ... end.
    np.testing.assert_allclose(logits, ref[len(PROMPT) - 1 :], atol=ATOL, rtol=0)
    assert tokens == ref[len(PROMPT) - 1 : -1].argmax(axis=-1).tolist()


LONG = [(37 * i + 11) % 300 + 3 for i in range(40)]
LONG_ATOL = 5e-4  # fp32 over a 30-token prefill against the float64 reference: measured up to 1.4e-4


@pytest.mark.parametrize("family", DENSE_FAMILIES + HYBRID_FAMILIES)
def test_a_long_forward_returns_logits_at_every_position_and_num_logits_keeps_the_last_rows(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    session = sessions[family]
    spec = spec_of(family)
    ref = reference_logits(spec, make_weights(spec), LONG)
    state = session.new_state(64)
    full = session.forward(state, np.asarray([LONG[:30]]))
    assert full.shape == (1, 30, spec.vocab_size)
    np.testing.assert_allclose(full[0], ref[:30], atol=LONG_ATOL, rtol=0)
    steps = [session.forward(state, np.asarray([[t]]))[0, -1] for t in LONG[30:]]
    np.testing.assert_allclose(np.stack(steps), ref[30:], atol=LONG_ATOL, rtol=0)
    last = session.forward(session.new_state(64), np.asarray([LONG[:30]]), 3)
    assert last.shape == (1, 3, spec.vocab_size)
    np.testing.assert_array_equal(last, full[:, -3:])


@pytest.mark.parametrize("family", DENSE_FAMILIES + HYBRID_FAMILIES)
def test_a_batch_of_two_equal_length_prompts_decodes_each_row_like_the_reference(
    sessions: dict[str, DecoderSession], family: str
) -> None:
    session = sessions[family]
    spec = spec_of(family)
    rows = [LONG[:12], LONG[20:32]]
    state = session.new_state(16, batch=2)
    prefill = session.forward(state, np.asarray(rows))
    step = session.forward(state, np.asarray([[5], [9]]))
    for row, (prompt, token) in enumerate(zip(rows, (5, 9), strict=True)):
        ref = reference_logits(spec, make_weights(spec), [*prompt, token])
        np.testing.assert_allclose(prefill[row], ref[:-1], atol=ATOL, rtol=0)
        np.testing.assert_allclose(step[row, 0], ref[-1], atol=ATOL, rtol=0)
