"""The numpy Gated DeltaNet reference against hand-derived cases."""

from __future__ import annotations

import numpy as np

from onnxgen.testing.reference_linear import causal_conv_ref, gated_delta_ref, gated_deltanet_layer_ref
from onnxgen.testing.spec import TinySpec, make_weights


def test_causal_conv_equals_a_per_channel_full_convolution_of_state_and_input() -> None:
    rng = np.random.default_rng(0)
    mixed = rng.standard_normal((2, 5, 3))
    kernel = rng.standard_normal((3, 1, 4))
    state = rng.standard_normal((2, 3, 3))
    act, present = causal_conv_ref(mixed, kernel, state)
    for b in range(2):
        for c in range(3):
            seq = np.concatenate([state[b, c], mixed[b, :, c]])
            want = np.convolve(seq, kernel[c, 0, ::-1], mode="valid")  # correlation = flipped convolution
            np.testing.assert_allclose(act[b, :, c], want / (1 + np.exp(-want)))
            np.testing.assert_array_equal(present[b, c], seq[-3:])


def test_one_token_from_zero_state_writes_beta_k_outer_v_and_reads_it_with_q() -> None:
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 1, 1, 1, 3))
    v = rng.standard_normal((1, 1, 1, 2))
    g, beta = np.array([[[-0.7]]]), np.array([[[0.4]]])
    o, s = gated_delta_ref(q, k, v, g, beta, np.zeros((1, 1, 3, 2)))
    np.testing.assert_allclose(s[0, 0], 0.4 * np.outer(k[0, 0, 0], v[0, 0, 0]))
    np.testing.assert_allclose(o[0, 0, 0], 0.4 * (q[0, 0, 0] @ k[0, 0, 0]) * v[0, 0, 0])


def test_a_zero_key_only_decays_the_state_and_reads_the_decayed_state() -> None:
    rng = np.random.default_rng(2)
    s0 = rng.standard_normal((1, 2, 3, 2))
    q = rng.standard_normal((1, 2, 2, 3))
    g = np.array([[[-0.5, -1.0], [-0.25, -2.0]]])
    o, s = gated_delta_ref(
        q, np.zeros((1, 2, 2, 3)), rng.standard_normal((1, 2, 2, 2)), g, np.ones((1, 2, 2)), s0
    )
    np.testing.assert_allclose(s, s0 * np.exp(g.sum(axis=1))[:, :, None, None])
    np.testing.assert_allclose(o[0, 1, 1], q[0, 1, 1] @ s[0, 1])


def test_the_layer_reference_is_causal_and_splits_cleanly_over_time() -> None:
    spec = TinySpec(hidden=16, num_layers=1, layer_types=("linear",), lin_key_dim=4, lin_value_dim=4)
    w = make_weights(spec)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    conv = np.zeros((2, spec.conv_dim, 3), np.float32)
    rec = np.zeros((2, 4, 4, 4), np.float32)
    y, c, r = gated_deltanet_layer_ref(x, w, spec, 0, conv, rec)
    y1, c1, r1 = gated_deltanet_layer_ref(x[:, :2], w, spec, 0, conv, rec)
    y2, c2, r2 = gated_deltanet_layer_ref(x[:, 2:], w, spec, 0, c1, r1)
    np.testing.assert_allclose(np.concatenate([y1, y2], axis=1), y, atol=1e-6)
    np.testing.assert_allclose(c2, c, atol=1e-6)
    np.testing.assert_allclose(r2, r, atol=1e-6)
    assert not np.allclose(y[1], y[0])  # batch rows are independent inputs, not broadcast copies
