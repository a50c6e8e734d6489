"""The demo model's training pipeline (tools/demo_model): data mixing, the fast Gated DeltaNet, the MTP head
and its checkpoint tensors, the command line. Tests that need torch / transformers / onnxruntime-genai skip
cleanly without them."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from onnxgen.llm import default_model_dir


def test_the_fast_gated_delta_rule_matches_transformers() -> None:
    torch = pytest.importorskip("torch")
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from tools.demo_model.gdn import chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 70, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(2, 70, 4, 8, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(2, 70, 4, generator=gen))
    beta = torch.rand(2, 70, 4, generator=gen)
    state = torch.randn(2, 4, 16, 8, generator=gen)
    kwargs = {"initial_state": state, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    want_out, want_state = qwen.torch_chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(final, want_state, atol=1e-5, rtol=1e-4)


def test_the_fast_causal_convolution_matches_transformers_with_its_gradients() -> None:
    torch = pytest.importorskip("torch")
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from tools.demo_model.gdn import causal_conv1d_fn

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 40, generator=gen, requires_grad=True)
    weight = torch.randn(12, 4, generator=gen, requires_grad=True)
    want = qwen.causal_conv1d_fn(x, weight, None, activation="silu")
    (want_dx, want_dw) = torch.autograd.grad(want.square().sum(), (x, weight))
    got = causal_conv1d_fn(x, weight, None, activation="silu")
    (dx, dw) = torch.autograd.grad(got.square().sum(), (x, weight))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, want_dx, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(dw, want_dw, atol=1e-4, rtol=1e-5)
    shifted = causal_conv1d_fn(torch.roll(x, 1, -1), weight, None, activation="silu")
    assert not torch.allclose(
        shifted[..., 1:], want[..., 1:]
    )  # the output depends on the order of time steps


def test_copy_windows_write_every_span_twice_in_a_row() -> None:
    from tools.demo_model.data import copy_window

    stream = np.arange(10_000, dtype=np.uint16)  # distinct ids: a span's place in the stream is its ids
    row = copy_window(stream, 513, np.random.default_rng(3))
    assert row.shape == (513,)
    i = 0
    while i < 513:  # each span is a run of consecutive ids followed by the same run
        n = 1
        while i + n < 513 and row[i + n] == row[i + n - 1] + 1:
            n += 1
        assert 8 <= n <= 96 or i + n == 513
        second = row[i + n : i + 2 * n]
        assert np.array_equal(second, row[i : i + len(second)])
        i += 2 * n


def test_quote_windows_repeat_one_long_span_two_to_four_times_inside_text() -> None:
    from tools.demo_model.data import quote_window

    stream = np.arange(60_000, dtype=np.uint16)  # distinct ids: ids seen twice in a row belong to the span
    copies, lengths, gaps = set(), set(), set()
    for seed in range(40):
        row = quote_window(stream, 513, np.random.default_rng(seed))
        assert row.shape == (513,)
        ids, counts = np.unique(row, return_counts=True)
        span = ids[counts >= 2]
        assert 16 <= len(span) <= 513 // 3 and np.all(np.diff(span) == 1)  # one span of the stream
        starts = np.flatnonzero(row == span[0])
        for at in starts[:-1]:  # every copy but the last (which the row may cut) is the whole span
            assert np.array_equal(row[at : at + len(span)], span)
        copies.add(len(starts))
        lengths.add(len(span))
        gaps.update(int(b - a - len(span)) for a, b in itertools.pairwise(starts))
    assert copies >= {2, 3} and copies <= {2, 3, 4}
    assert 0 in gaps and max(gaps) > 16 and max(gaps) <= 64  # copies adjacent or apart
    assert min(lengths) < 60 and max(lengths) > 120


def test_training_batches_depend_on_seed_and_step_only_and_mix_in_copy_windows() -> None:
    from tools.demo_model.data import batch_at

    stream = np.arange(50_000, dtype=np.uint16)
    a = batch_at(stream, 7, 64, 128, 0, repeat_share=0.25)
    assert np.array_equal(a, batch_at(stream, 7, 64, 128, 0, repeat_share=0.25))
    assert not np.array_equal(a, batch_at(stream, 8, 64, 128, 0, repeat_share=0.25))
    plain = np.all(np.diff(a, axis=1) == 1, axis=1)  # a window of the stream counts up by one
    assert 4 <= int((~plain).sum()) <= 32  # about a quarter of 64 rows are copy windows
    assert np.all(np.diff(batch_at(stream, 7, 64, 128, 0), axis=1) == 1)  # share 0: stream windows only


def test_random_copy_rows_repeat_spans_of_random_ordinary_ids() -> None:
    from tools.demo_model.data import batch_at, random_copy_window

    row = random_copy_window(513, (3, 4096), np.random.default_rng(5))
    assert row.shape == (513,) and row.min() >= 3 and row.max() < 4096
    assert len(np.unique(row)) > 100  # random ids, not a run of the stream
    stream = np.arange(50_000, dtype=np.uint16)
    a = batch_at(stream, 7, 64, 128, 0, repeat_share=0.25, random_share=0.25, id_range=(60_000, 61_000))
    random_rows = np.all(a >= 60_000, axis=1)
    assert 4 <= int(random_rows.sum()) <= 32  # about a quarter of 64 rows
    copies = ~random_rows & ~np.all(np.diff(a, axis=1) == 1, axis=1)
    assert 4 <= int(copies.sum()) <= 32


def test_batches_mix_in_quote_windows_by_share() -> None:
    from tools.demo_model.config import DemoConfig
    from tools.demo_model.data import batch_at

    stream = np.arange(50_000, dtype=np.uint16)
    a = batch_at(stream, 7, 64, 128, 0, quote_share=0.5)
    quoted = ~np.all(np.diff(a, axis=1) == 1, axis=1)
    assert 16 <= int(quoted.sum()) <= 48
    for row in a[quoted]:
        assert np.unique(row).size < row.size  # a span recurs
    cfg = DemoConfig(steps=10, copy_phase_steps=5, quote_share=0.1, copy_phase_quote_share=0.25)
    assert cfg.row_shares(9)[2] == 0.1 and cfg.row_shares(10)[2] == 0.25


def test_the_dense_demo_config_has_every_layer_full_attention_and_is_not_installable() -> None:
    from tools.demo_model.config import DemoConfig
    from tools.demo_model.train import _parser, config_from_args, main

    cfg = config_from_args(_parser().parse_args(["--dense", "--steps", "30", "--copy-phase-steps", "20"]))
    assert cfg.dense and cfg.total_steps == 50
    assert cfg.layer_types() == ["full_attention"] * cfg.layers
    assert cfg.text_config_kwargs()["layer_types"] == cfg.layer_types()
    hybrid = DemoConfig().layer_types()
    assert "linear_attention" in hybrid and hybrid.count("full_attention") == 2
    with pytest.raises(SystemExit):
        main(["--dense", "--install"])


def test_prompt_lookup_replay_counts_drafts_and_acceptances() -> None:
    from tools.demo_model.measure import simulate_prompt_lookup

    # the repeated [1, 2] proposes [3, 4, 5] (trimmed so the last token stays the model's): all accepted
    copied = simulate_prompt_lookup([1, 2, 3, 4, 5, 1, 2], [3, 4, 5, 9])
    assert (copied.verify_steps, copied.drafted, copied.accepted) == (1, 3, 3)
    # [7, 8] proposes [9, 7] but the model says 1; then nothing matches
    missed = simulate_prompt_lookup([7, 8, 9, 7, 8], [1, 2, 3])
    assert (missed.verify_steps, missed.drafted, missed.accepted) == (3, 2, 0)
    assert missed.acceptance == 0.0 and copied.tokens_per_step == 4.0


def test_the_training_conversations_render_like_the_bundled_chat_template() -> None:
    from onnxgen.tokenizer import Tokenizer
    from tools.demo_model.corpus import SYSTEM_PROMPT, chatml

    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hi"}]
    rendered = Tokenizer.from_dir(default_model_dir()).apply_chat_template(
        messages, add_generation_prompt=True
    )
    turns = [("system", SYSTEM_PROMPT), ("user", "Hi")]
    assert rendered == chatml(turns) + "<|im_start|>assistant\n"


@pytest.mark.slow
def test_the_demo_tokenizer_rebuilt_from_the_corpus_is_the_bundled_one(tmp_path: Path) -> None:
    """The pipeline's tokenizer (onnxgen.testing's BPE setup and save, trained on the training documents)
    rebuilt from the standard library is the bundled tokenizer.json byte for byte, once compacted as
    installing does (the builder re-saves it unchanged)."""
    import sys

    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    if sys.version_info[:3] != (3, 11, 7):
        pytest.skip("the bundled tokenizer was trained on CPython 3.11.7's standard library")
    from onnxgen.testing._hf_tokenizer import save_pretrained
    from tools.demo_model.corpus import build_corpus
    from tools.demo_model.data import training_documents
    from tools.demo_model.tokenizer import train_bpe

    save_pretrained(train_bpe(training_documents(build_corpus(seed=0), 0), 4096), tmp_path, 1024)
    rebuilt = json.loads((tmp_path / "tokenizer.json").read_text())
    compact = json.dumps(rebuilt, ensure_ascii=False, separators=(",", ":"))
    assert compact == (default_model_dir() / "tokenizer.json").read_text(encoding="utf-8")


def test_loop_at_finds_a_block_repeated_back_to_back_and_not_short_legitimate_repeats() -> None:
    from tools.demo_model.evaluate import loop_at

    assert loop_at([5, 6, 7] + [9] * 12) == (3, 1)  # " string" twelve times
    assert loop_at([1, 2] + [3, 4, 5, 6] * 3 + [7]) == (2, 4)  # a clause three times
    assert loop_at([9] * 11) is None  # too short to call a loop
    assert loop_at([1, 2, 3, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) is None  # a line written twice
    assert loop_at(list(range(64))) is None


def test_set_overrides_any_config_field_and_names_the_fields_when_it_cannot() -> None:
    from tools.demo_model.train import _parser, config_from_args

    cfg = config_from_args(_parser().parse_args(["--set", "mtp_weight=0", "--set", "intermediate=96"]))
    assert cfg.mtp_weight == 0.0 and cfg.intermediate == 96
    assert cfg.text_config_kwargs()["mtp_num_hidden_layers"] == 0
    for bad in ("mtp_wieght=0", "intermediate", "intermediate=wide"):
        with pytest.raises(SystemExit, match=r"intermediate|FIELD"):
            config_from_args(_parser().parse_args(["--set", bad]))
    for bad in ("schedule=linear", "decay_steps=6800"):  # the cooldown must fit after the warmup
        with pytest.raises(SystemExit, match=r"invalid settings: (schedule|decay_steps)"):
            config_from_args(_parser().parse_args(["--set", "schedule=wsd", "--set", bad]))


# a demo geometry small enough to train and export in seconds (the bundled tokenizer's 4096 ids)
TINY = {
    "hidden": 64,
    "intermediate": 96,
    "layers": 4,
    "heads": 2,
    "kv_heads": 1,
    "head_dim": 32,
    "lin_key_heads": 1,
    "lin_value_heads": 2,
    "lin_head_dim": 16,
    "seq_len": 128,  # copy windows need spans of up to 96 ids
    "batch": 2,
}


def _tiny_model(**overrides: Any) -> tuple[Any, Any]:
    """A DemoModel of the tiny geometry whose head norms are not all zero (so ``1 + weight`` matters)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tools.demo_model.config import DemoConfig
    from tools.demo_model.model import DemoModel

    config = DemoConfig(**TINY, **overrides)
    model = DemoModel(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.mtp.named_parameters():
            if "norm" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
            else:
                param.mul_(10.0)  # beyond the 0.02 init: logits far from uniform
        model.lm.model.embed_tokens.weight.mul_(20.0)
    return config, model


def test_the_mtp_reference_is_the_trained_heads_forward_with_and_without_a_kv_cache() -> None:
    torch = pytest.importorskip("torch")
    from tools.demo_model.model import head_logits
    from tools.demo_model.mtp import mtp_reference

    config, model = _tiny_model()
    ids = torch.randint(3, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model.lm.model(input_ids=ids).last_hidden_state
        want = head_logits(model.lm, model.mtp, hidden[:, :-1], ids[:, 1:])
        weights, text = model.mtp.checkpoint_tensors(), config.text_config().to_dict()
        embed = model.lm.model.embed_tokens.weight
        got, _, _ = mtp_reference(weights, text, embed, hidden[:, :-1], ids[:, 1:])
        first, _, past = mtp_reference(weights, text, embed, hidden[:, :15], ids[:, 1:16])
        rest, _, _ = mtp_reference(weights, text, embed, hidden[:, 15:-1], ids[:, 16:], start=15, past=past)
        # negative control: the hidden state first in the concatenation (the other order) is another head
        h = config.hidden
        swapped = dict(weights)
        swapped["mtp.fc.weight"] = torch.cat(
            [weights["mtp.fc.weight"][:, h:], weights["mtp.fc.weight"][:, :h]], 1
        )
        pairs = (weights["mtp.pre_fc_norm_embedding.weight"], weights["mtp.pre_fc_norm_hidden.weight"])
        swapped["mtp.pre_fc_norm_embedding.weight"], swapped["mtp.pre_fc_norm_hidden.weight"] = pairs[::-1]
        wrong, _, _ = mtp_reference(swapped, text, embed, hidden[:, :-1], ids[:, 1:])
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat([first, rest], 1), want, atol=2e-5, rtol=1e-4)
    assert (wrong - want).abs().max() > 0.1


def test_the_head_at_position_t_reads_tokens_up_to_t_plus_1_only() -> None:
    """Causal: changing token k changes the head's logits from position k - 1 on, none before."""
    torch = pytest.importorskip("torch")
    from tools.demo_model.model import head_logits

    _, model = _tiny_model()
    ids = torch.randint(3, 4096, (1, 20), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, 12] = 7 if int(ids[0, 12]) != 7 else 8
    with torch.no_grad():
        a, b = (
            head_logits(model.lm, model.mtp, model.lm.model(input_ids=x).last_hidden_state[:, :-1], x[:, 1:])
            for x in (ids, changed)
        )
    differs = (a - b).abs().amax(-1)[0]
    assert torch.all(differs[:11] == 0) and torch.all(differs[11:] > 0)


def test_training_trains_the_head_and_an_interrupted_run_resumes_exactly(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tools.demo_model.config import DemoConfig
    from tools.demo_model.trainer import train

    config = DemoConfig(**TINY, steps=3, copy_phase_steps=1, eval_every=2, eval_windows=2, warmup=1)
    stream = np.random.default_rng(0).integers(3, 4096, size=4000).astype(np.uint16)

    class Interrupt(Exception):
        pass

    def stop_at_two(line: str) -> None:
        if line.startswith("step=2 "):
            raise Interrupt

    whole = train(config, stream, stream[:200], tmp_path / "whole", log=lambda _: None)
    with pytest.raises(Interrupt):
        train(config, stream, stream[:200], tmp_path / "resumed", log=stop_at_two)
    resumed = train(config, stream, stream[:200], tmp_path / "resumed", log=lambda _: None)
    names = [n for n, _ in whole.named_parameters()]
    assert any(n.startswith("mtp.layers.0.self_attn") for n in names)
    for (name, a), (_, b) in zip(whole.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    log = [json.loads(line) for line in (tmp_path / "whole" / "train_log.jsonl").read_text().splitlines()]
    assert all("mtp_loss" in e for e in log) and "val_mtp_agree" in log[1]


def _same_weights(a: Any, b: Any) -> bool:
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _same_optimizer_state(a: Path, b: Path) -> int:
    """The step of two runs' last checkpoints, after checking that they hold the same AdamW state."""
    import torch

    from tools.demo_model.trainer import CHECKPOINT

    x, y = (torch.load(run / CHECKPOINT, weights_only=False) for run in (a, b))
    assert x["step"] == y["step"]
    for (i, p), (j, q) in zip(x["opt"]["state"].items(), y["opt"]["state"].items(), strict=True):
        assert i == j and all(torch.equal(p[k], q[k]) for k in p)
    return int(x["step"])


def test_a_run_of_2x_steps_equals_x_steps_then_a_resume_for_x_more_bit_for_bit(tmp_path: Path) -> None:
    """``until`` stops a run after step x with a checkpoint (model, AdamW state, step, config; the data
    position is the step); resuming it for x more steps, across the cooldown into the copy phase, gives
    the weights and optimizer state of the uninterrupted run bit for bit, though the resumed part
    evaluates and checkpoints at other steps. A resume from a checkpoint whose AdamW moments were lost
    does not (the comparison can fail)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tools.demo_model.config import DemoConfig
    from tools.demo_model.trainer import CHECKPOINT, train

    config = DemoConfig(
        **TINY,
        steps=6,
        copy_phase_steps=2,
        schedule="wsd",
        decay_steps=3,
        warmup=1,
        eval_every=3,
        eval_windows=1,
    )
    stream = np.random.default_rng(0).integers(3, 4096, size=4000).astype(np.uint16)
    quiet = lambda _: None  # noqa: E731
    whole = train(config, stream, stream[:200], tmp_path / "whole", quiet)
    first = train(config, stream, stream[:200], tmp_path / "split", quiet, until=4)
    assert not _same_weights(first, whole)
    state = torch.load(tmp_path / "split" / CHECKPOINT, weights_only=False)
    assert state["step"] == 4 and state["opt"]["state"]
    shutil.copytree(tmp_path / "split", tmp_path / "lost")
    other_bookkeeping = dataclasses.replace(config, eval_every=5, checkpoint_every=1, keep_every=2)
    resumed = train(other_bookkeeping, stream, stream[:200], tmp_path / "split", quiet)
    assert _same_weights(resumed, whole)
    assert _same_optimizer_state(tmp_path / "whole", tmp_path / "split") == 8
    assert sorted(p.name for p in (tmp_path / "split").glob("step-*.pt")) == [
        "step-0000006.pt",
        "step-0000008.pt",
    ]
    for moments in state["opt"]["state"].values():  # the negative control
        moments["exp_avg_sq"].zero_()
    torch.save(state, tmp_path / "lost" / CHECKPOINT)
    assert not _same_weights(train(config, stream, stream[:200], tmp_path / "lost", quiet), whole)


def test_a_wsd_run_extends_and_branches_into_its_cooldown_but_a_cosine_run_does_not(tmp_path: Path) -> None:
    """The constant part of a ``wsd`` schedule does not depend on ``steps``: a checkpoint of a run planned
    for 1000 steps resumes as a run of 7 (cooldown from step 4, copy phase after 7) and ends with the
    weights of that run trained directly. Refused: the same checkpoint as a run whose cooldown began
    before it (from step 2, so step 3's rate differs), and a cosine run's checkpoint under another
    length."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tools.demo_model.config import DemoConfig
    from tools.demo_model.trainer import same_steps_until, train

    short = DemoConfig(
        **TINY, steps=7, copy_phase_steps=1, schedule="wsd", decay_steps=3, warmup=1, eval_every=4
    )
    long = dataclasses.replace(short, steps=1000)
    stream = np.random.default_rng(0).integers(3, 4096, size=4000).astype(np.uint16)
    quiet = lambda _: None  # noqa: E731
    direct = train(short, stream, stream[:200], tmp_path / "direct", quiet)
    train(long, stream, stream[:200], tmp_path / "long", quiet, until=4)
    shutil.copytree(tmp_path / "long", tmp_path / "early")
    branched = train(short, stream, stream[:200], tmp_path / "long", quiet)
    assert _same_weights(branched, direct)
    with pytest.raises(RuntimeError, match="other settings"):
        train(dataclasses.replace(short, steps=5), stream, stream[:200], tmp_path / "early", quiet)
    cosine = dataclasses.replace(short, schedule="cosine", min_lr=1e-4)
    assert same_steps_until(cosine, cosine, 4)
    assert not same_steps_until(dataclasses.replace(cosine, steps=1000), cosine, 4)
    assert not same_steps_until(long, dataclasses.replace(short, lr=1e-3), 4)
    assert not same_steps_until(long, short, 9)  # past the end of the run it would resume as


def test_resume_reads_the_settings_from_the_checkpoint_and_branches_into_another_directory(
    tmp_path: Path,
) -> None:
    torch = pytest.importorskip("torch")
    from tools.demo_model.config import DemoConfig
    from tools.demo_model.train import _parser, branch, config_from_args, resume_point, saved_config

    run = tmp_path / "run"
    (run / "train").mkdir(parents=True)
    (run / "data").mkdir()
    (run / "data" / "meta.json").write_text("{}")
    (run / "train" / "head_cache" / "val").mkdir(parents=True)  # a head-only run's decoder states
    (run / "train" / "head_cache" / "val" / "meta.json").write_text('{"decoder_sha256": "x"}')
    saved = DemoConfig(**TINY, schedule="wsd", steps=1000, decay_steps=100, threads=1)
    torch.save({"config": saved.to_dict(), "step": 300}, run / "train" / "last.pt")
    torch.save({"config": saved.to_dict(), "step": 200}, run / "train" / "step-0000200.pt")
    assert resume_point(run) == (run, run / "train" / "last.pt")
    assert resume_point(run / "train" / "step-0000200.pt") == (run, run / "train" / "step-0000200.pt")
    for bad in (tmp_path, run / "data" / "meta.json"):
        with pytest.raises(SystemExit, match="--resume"):
            resume_point(bad)
    args = _parser().parse_args(["--resume", str(run), "--steps", "400", "--set", "eval_every=10"])
    written, step = saved_config(run / "train" / "last.pt")
    config = config_from_args(args, written)
    assert step == 300 and config == dataclasses.replace(saved, steps=400, eval_every=10)
    branch(run, run / "train" / "step-0000200.pt", tmp_path / "cool")
    assert torch.load(tmp_path / "cool" / "train" / "last.pt", weights_only=False)["step"] == 200
    assert (tmp_path / "cool" / "data" / "meta.json").is_file()
    cached = tmp_path / "cool" / "train" / "head_cache" / "val" / "meta.json"
    assert cached.read_text() == '{"decoder_sha256": "x"}'  # the branch trains from the same states
    with pytest.raises(SystemExit, match="already holds a run"):
        branch(run, run / "train" / "last.pt", tmp_path / "cool")


@pytest.mark.external
def test_the_checkpoint_carries_the_head_that_onnxruntime_genai_exports_as_the_reference_computes(
    tmp_path: Path,
) -> None:
    """The head's tensors travel in the checkpoint's safetensors in the naming onnxruntime-genai's builder
    reads; the builder's mtp.onnx (an independent implementation) computes what :func:`mtp_reference`
    does, over a prompt and over a chained step from the head's own hidden state and KV cache."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxruntime_genai")
    import onnxruntime as ort
    from transformers import Qwen3_5ForConditionalGeneration

    from onnxgen.testing.hf import export_with_genai_builder
    from tools.demo_model.export import save_hf_checkpoint
    from tools.demo_model.mtp import mtp_reference, read_mtp_tensors

    config, model = _tiny_model()
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir() / name, tok / name)
    hf = save_hf_checkpoint(model, config, tok, tmp_path / "hf")
    head = read_mtp_tensors(hf)
    assert head.keys() == model.mtp.checkpoint_tensors().keys()
    for name, tensor in model.mtp.checkpoint_tensors().items():
        assert torch.equal(head[name], tensor), name
    reloaded = Qwen3_5ForConditionalGeneration.from_pretrained(hf).eval()  # transformers skips mtp.*
    ids = torch.randint(3, 4096, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model.lm(input_ids=ids).logits)

    out = export_with_genai_builder(hf, tmp_path / "onnx", "fp32")  # with its MTP head: mtp.onnx
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    decoder, mtp = (
        ort.InferenceSession(str(out / name), options, providers=["CPUExecutionProvider"])
        for name in ("model.onnx", "mtp.onnx")
    )

    def feeds(session: Any, tokens: np.ndarray, start: int, **given: np.ndarray) -> dict[str, np.ndarray]:
        n = tokens.shape[1]
        f = {"input_ids": tokens, "attention_mask": np.ones((1, start + n), np.int64)}
        f["position_ids"] = np.broadcast_to(np.arange(start, start + n), (3, 1, n)).astype(np.int64)
        for port in session.get_inputs():
            if port.name.startswith("past") and port.name not in given:
                shape = (
                    [1, port.shape[1], 0, config.head_dim]
                    if "key_values" in port.name
                    else [1, *port.shape[1:]]
                )
                f[port.name] = np.zeros(shape, np.float32)
        return f | given

    x = ids.numpy()
    hidden = decoder.run(["hidden_states"], feeds(decoder, x, 0))[0]
    with torch.no_grad():
        final = model.lm.model(input_ids=ids).last_hidden_state.numpy()
    # the decoder's hidden state is the final norm's output (up to the chunked vs recurrent delta rule's
    # rounding; the state before the norm differs by its scale)
    np.testing.assert_allclose(hidden, final, atol=2e-3)
    text, embed = config.text_config().to_dict(), model.lm.model.embed_tokens.weight.detach()
    logits, key, value, state = mtp.run(None, feeds(mtp, x[:, 1:13], 0, hidden_states=hidden[:, :12]))
    with torch.no_grad():
        want, want_state, past = mtp_reference(
            head, text, embed, torch.from_numpy(hidden[:, :12]), ids[:, 1:13]
        )
    np.testing.assert_allclose(logits, want.numpy(), atol=1e-4)
    np.testing.assert_allclose(state, want_state.numpy(), atol=1e-4)
    draft = logits[:, -1:].argmax(-1)  # chain: the head's own token and hidden state, its KV cache
    chained = mtp.run(
        ["logits"],
        feeds(
            mtp,
            draft,
            12,
            hidden_states=state[:, -1:],
            **{"past_key_values.0.key": key, "past_key_values.0.value": value},
        ),
    )[0]
    with torch.no_grad():
        want_chained, _, _ = mtp_reference(
            head, text, embed, want_state[:, -1:], torch.from_numpy(draft), start=12, past=past
        )
    np.testing.assert_allclose(chained, want_chained.numpy(), atol=1e-4)


def test_installing_copies_the_export_with_its_head_and_refuses_one_without(tmp_path: Path) -> None:
    from tools.demo_model.export import BUNDLED_FILES, HEAD_FILES, install_default

    export, target = tmp_path / "fp32", tmp_path / "default_model"
    export.mkdir()
    for name in BUNDLED_FILES:
        (export / name).write_text(name)
    tokenizer = {"model": {"type": "BPE", "vocab": {"a": 0, "é": 1}}, "added_tokens": []}
    (export / "tokenizer.json").write_text(json.dumps(tokenizer, indent=2))
    target.mkdir()
    (target / "stale.onnx").write_text("old")
    install_default(export, target)
    assert sorted(p.name for p in target.iterdir()) == sorted([*BUNDLED_FILES, "NOTICE.txt"])
    assert (target / "mtp.onnx").read_text() == "mtp.onnx"
    # the tokenizer is the same JSON, written without indentation
    written = (target / "tokenizer.json").read_text()
    assert json.loads(written) == tokenizer and "\n" not in written
    for name in HEAD_FILES:
        (export / name).unlink()
        with pytest.raises(FileNotFoundError, match=name):
            install_default(export, target)
        (export / name).write_text(name)
    assert (target / "mtp.onnx").is_file()  # a refused install leaves the bundled model as it was


def test_head_only_training_moves_the_head_and_leaves_the_model_it_started_from_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``head_only``: the warm-started model is what the run returns, bit for bit, and the head trains; the
    same run without ``head_only`` (the negative control) moves the model."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tools.demo_model import warmstart
    from tools.demo_model.config import DemoConfig
    from tools.demo_model.model import DemoModel
    from tools.demo_model.trainer import train

    earlier = DemoModel(DemoConfig(**TINY, seed=7)).lm.state_dict()  # not seed 0's initialization

    def load_earlier(model: Any, config: Any, export_dir: Path, train_ids: np.ndarray) -> dict[str, float]:
        model.lm.load_state_dict(earlier)
        return {"export_logit_diff": 0.0, "pruned_channels": 0}

    monkeypatch.setattr(warmstart, "init_from_export", load_earlier)
    stream = np.random.default_rng(0).integers(3, 4096, size=4000).astype(np.uint16)
    base = {**TINY, "steps": 3, "copy_phase_steps": 0, "warmup": 1, "eval_every": 100, "eval_windows": 1}
    base.update(head_rows=4, head_batch=2, head_context=32)
    base["init_from"] = str(tmp_path / "earlier")
    quiet = lambda _: None  # noqa: E731

    head_only = train(DemoConfig(**base, head_only=True), stream, stream[:200], tmp_path / "head", quiet)
    for name, tensor in head_only.lm.state_dict().items():
        assert torch.equal(tensor, earlier[name]), name
    fresh_head = DemoModel(DemoConfig(**TINY)).mtp.state_dict()
    assert any(not torch.equal(t, fresh_head[n]) for n, t in head_only.mtp.state_dict().items())

    joint = train(DemoConfig(**base), stream, stream[:200], tmp_path / "joint", quiet)
    assert any(not torch.equal(t, earlier[n]) for n, t in joint.lm.state_dict().items())

    with pytest.raises(ValueError, match="init_from"):
        train(DemoConfig(**TINY, head_only=True), stream, stream[:200], tmp_path / "none", quiet)


def test_mlp_pruning_keeps_the_channels_that_carry_the_most_output() -> None:
    torch = pytest.importorskip("torch")
    from tools.demo_model.warmstart import prune_mlp

    gen = torch.Generator().manual_seed(0)
    hidden, width = 8, 6
    gate, up = torch.randn(width, hidden, generator=gen), torch.randn(width, hidden, generator=gen)
    down = torch.randn(hidden, width, generator=gen)
    down[:, [1, 4]] *= 1e-3  # channels 1 and 4 barely reach the output
    p = "model.layers.0.mlp."
    state = {p + "gate_proj.weight": gate, p + "up_proj.weight": up, p + "down_proj.weight": down}
    x = torch.randn(32, hidden, generator=gen)
    pruned = prune_mlp(state, 4, lambda layer: x)
    keep = [0, 2, 3, 5]
    assert torch.equal(pruned[p + "gate_proj.weight"], gate[keep])
    assert torch.equal(pruned[p + "up_proj.weight"], up[keep])
    assert torch.equal(pruned[p + "down_proj.weight"], down[:, keep])


@pytest.mark.external
def test_a_model_read_back_from_its_builder_export_is_the_model_that_was_exported(tmp_path: Path) -> None:
    """The warm start's reading of an fp32 export (transposed Linear weights, fused q/k/v, ``1 + w``
    norms, ``-exp(A_log)``) gives back the trained model's tensors; a narrower config prunes the MLP."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxruntime_genai")
    from tools.demo_model.config import DemoConfig
    from tools.demo_model.export import export, save_hf_checkpoint
    from tools.demo_model.model import DemoModel
    from tools.demo_model.warmstart import init_from_export, state_dict_from_export

    config, model = _tiny_model()
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir() / name, tok / name)
    out = export(save_hf_checkpoint(model, config, tok, tmp_path / "hf"), tmp_path / "fp32", "fp32")
    state = state_dict_from_export(out)
    want = {k: v for k, v in model.lm.state_dict().items() if k != "lm_head.weight"}
    assert state.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6, msg=name)

    # the export's mtp.onnx (onnxgen export-mtp over the tied embedding), fp32: the trained head's forward
    from onnxgen.export.mtp import export_mtp
    from onnxgen.model.mtp import find_mtp_head, mtp_head_io
    from onnxgen.model.package import ModelPackage
    from onnxgen.runtime.mtp_head import MTPHeadSession
    from tools.demo_model.model import head_logits

    export_mtp(tmp_path / "hf", out, "fp32")
    package = ModelPackage.open(out)
    head = MTPHeadSession(mtp_head_io(package, find_mtp_head(package)), threads=1)
    ids = torch.randint(3, 4096, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = model.lm.model(input_ids=ids).last_hidden_state
        want = head_logits(model.lm, model.mtp, hidden[:, :-1], ids[:, 1:])[0].numpy()
    got, _ = head.forward(head.new_state(16), ids[:, 1:].numpy(), hidden[:, :-1].numpy())  # the last row's
    assert np.abs(want[-1]).max() > 1.0
    np.testing.assert_allclose(got, want[-1], rtol=1e-4, atol=1e-3)

    stream = np.random.default_rng(0).integers(3, 4096, size=20_000).astype(np.uint16)
    narrow = DemoConfig(**{**TINY, "intermediate": 64})
    student = DemoModel(narrow)
    info = init_from_export(student, narrow, out, stream)
    assert info["pruned_channels"] == 32 and info["export_logit_diff"] < 1e-2  # logits of size ~100
    assert student.lm.model.layers[0].mlp.gate_proj.weight.shape == (64, TINY["hidden"])


def test_the_head_cache_holds_the_frozen_decoders_hidden_states_and_is_rebuilt_when_it_changes(
    tmp_path: Path,
) -> None:
    """The cached states are the decoder's final-norm output over each row; a second run reuses them, and a
    decoder whose weights changed (the negative control) gets a new cache with its own states."""
    torch = pytest.importorskip("torch")
    from tools.demo_model.headcache import caches, training_rows

    config, model = _tiny_model(head_rows=6, eval_windows=2)
    stream = np.random.default_rng(0).integers(3, 4096, size=4000).astype(np.uint16)
    messages: list[str] = []
    made = caches(model.lm, config, stream, stream[:400], tmp_path, messages.append)
    train, val = made.train, made.val
    assert made.generated is None
    rows = training_rows(config, stream)
    assert rows.shape == (6, config.seq_len + 1) and np.array_equal(train.ids, rows)
    assert np.array_equal(training_rows(dataclasses.replace(config, head_rows=8), stream)[:6], rows)
    with torch.no_grad():
        want = model.lm.model(input_ids=torch.from_numpy(rows[:, :-1])).last_hidden_state.numpy()
        want_val = model.lm.model(input_ids=torch.from_numpy(val.ids[:, :-1])).last_hidden_state.numpy()
    assert train.hidden.shape == want.shape and val.ids.shape == (2, config.seq_len + 1)
    np.testing.assert_allclose(train.hidden, want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(val.hidden, want_val, atol=1e-4, rtol=1e-4)

    again = caches(model.lm, config, stream, stream[:400], tmp_path, messages.append).train
    assert any("reusing" in m for m in messages) and np.array_equal(again.hidden, train.hidden)

    with torch.no_grad():
        model.lm.model.layers[0].mlp.down_proj.weight.mul_(3.0)
        changed = model.lm.model(input_ids=torch.from_numpy(rows[:, :-1])).last_hidden_state.numpy()
    rebuilt = caches(model.lm, config, stream, stream[:400], tmp_path, messages.append).train
    assert any("rebuilding" in m for m in messages)
    assert np.abs(changed - want).max() > 1e-2
    np.testing.assert_allclose(rebuilt.hidden, changed, atol=1e-4, rtol=1e-4)


def test_the_generated_rows_are_the_decoders_greedy_continuations_with_their_states(tmp_path: Path) -> None:
    """``head_generated``: rows of a training prompt and the decoder's greedy continuation (each generated
    token is the argmax after the tokens before it), with the decoder's states over them; a quarter as many
    held-out ones."""
    torch = pytest.importorskip("torch")
    from tools.demo_model.headcache import caches

    config, model = _tiny_model(
        head_rows=2, eval_windows=1, head_generated=4, head_prompt=8, head_new_tokens=6
    )
    stream = np.random.default_rng(0).integers(3, 4096, size=4000).astype(np.uint16)
    made = caches(model.lm, config, stream, stream[:400], tmp_path, lambda _: None)
    assert made.generated is not None and made.generated_val is not None
    rows = made.generated.ids
    assert rows.shape == (4, 14) and made.generated_val.ids.shape == (1, 14)
    with torch.no_grad():
        out = model.lm(input_ids=torch.from_numpy(rows[:, :-1]), output_hidden_states=False)
        hidden = model.lm.model(input_ids=torch.from_numpy(rows[:, :-1])).last_hidden_state.numpy()
    assert np.array_equal(out.logits[:, 7:].argmax(-1).numpy(), rows[:, 8:])
    assert any(np.array_equal(row[:8], stream[i : i + 8]) for row in rows for i in range(stream.size - 8))
    np.testing.assert_allclose(made.generated.hidden, hidden, atol=1e-4, rtol=1e-4)


def test_the_heads_loss_distills_the_decoders_next_token_distribution_or_the_text() -> None:
    """``head_distill=1``: KL to the decoder's distribution at ``t+1`` (the lm_head over the cached state),
    blind to the text's token after next, zero for a head that reproduces the decoder; ``0``: the text's
    cross-entropy. The greedy target is the decoder's own argmax at ``t+1``."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from tools.demo_model.headcache import head_losses
    from tools.demo_model.model import head_logits

    _, model = _tiny_model()
    ids = torch.randint(3, 4096, (2, 18), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = model.lm.model(input_ids=ids[:, :-1]).last_hidden_state  # [2, 17, H]
        distilled, drafts, greedy = head_losses(model, hidden, ids, 1.0)
        other = ids.clone()  # another text token after the last position: the head's target only
        other[:, -1] = (other[:, -1] + 1) % 4096
        same, _, _ = head_losses(model, hidden, other, 1.0)
        text, _, _ = head_losses(model, hidden, ids, 0.0)
        text_other, _, _ = head_losses(model, hidden, other, 0.0)
        logits = head_logits(model.lm, model.mtp, hidden[:, :-1], ids[:, 1:-1])
        decoder = model.lm(input_ids=ids[:, :-1]).logits[:, 1:]
    assert distilled.shape == (2, 16)
    assert torch.equal(distilled, same) and not torch.equal(text[:, -1], text_other[:, -1])
    assert torch.equal(greedy, decoder.argmax(-1)) and torch.equal(drafts, logits.argmax(-1))
    want_text = F.cross_entropy(logits.flatten(0, 1), ids[:, 2:].flatten(), reduction="none").view(2, 16)
    torch.testing.assert_close(text, want_text)
    want_kl = F.kl_div(logits.log_softmax(-1), decoder.log_softmax(-1), log_target=True, reduction="none")
    torch.testing.assert_close(distilled, want_kl.sum(-1), atol=1e-5, rtol=1e-4)
    assert float(distilled.min()) > 0.01  # an untrained head is not the decoder


def test_head_only_training_from_the_cache_resumes_exactly(tmp_path: Path) -> None:
    """Head-only steps read crops of the cached states drawn from (seed, step): an interrupted run resumes
    to the same head. At a constant rate a run of 4 steps resumes from a longer run's checkpoint (the
    weights after step N do not depend on the planned length); with a cosine rate, whose steps before
    the checkpoint depend on it (the negative control), it refuses to."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tools.demo_model import warmstart
    from tools.demo_model.config import DemoConfig
    from tools.demo_model.model import DemoModel
    from tools.demo_model.trainer import train

    earlier = DemoModel(DemoConfig(**TINY, seed=7)).lm.state_dict()

    def load_earlier(model: Any, config: Any, export_dir: Path, train_ids: np.ndarray) -> dict[str, float]:
        model.lm.load_state_dict(earlier)
        return {"export_logit_diff": 0.0, "pruned_channels": 0}

    stream = np.random.default_rng(0).integers(3, 4096, size=4000).astype(np.uint16)
    config = DemoConfig(
        **TINY,
        steps=4,
        copy_phase_steps=0,
        warmup=1,
        lr=2e-3,
        min_lr=2e-3,
        eval_every=2,
        eval_windows=1,
        head_only=True,
        init_from=str(tmp_path / "earlier"),
        head_rows=4,
        head_batch=3,
        head_context=40,
        head_generated=2,
        head_prompt=8,
        head_new_tokens=8,
    )

    class Interrupt(Exception):
        pass

    def stop_at_two(line: str) -> None:
        if line.startswith("step=2 "):
            raise Interrupt

    quiet = lambda _: None  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(warmstart, "init_from_export", load_earlier)
        whole = train(config, stream, stream[:200], tmp_path / "whole", quiet)
        longer = dataclasses.replace(config, steps=6)
        with pytest.raises(Interrupt):
            train(longer, stream, stream[:200], tmp_path / "resumed", log=stop_at_two)
        resumed = train(config, stream, stream[:200], tmp_path / "resumed", quiet)
        # a cosine rate over 8 steps differs from one over 4 from step 2 on: its checkpoint at 4 is refused
        decaying = dataclasses.replace(config, min_lr=1e-4)
        train(dataclasses.replace(decaying, steps=8), stream, stream[:200], tmp_path / "cos", quiet, until=4)
        with pytest.raises(RuntimeError, match="other settings"):
            train(decaying, stream, stream[:200], tmp_path / "cos", quiet)
    for (name, a), (_, b) in zip(whole.mtp.named_parameters(), resumed.mtp.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    for name, tensor in whole.lm.state_dict().items():
        assert torch.equal(tensor, earlier[name]), name
    assert (tmp_path / "whole" / "head_cache" / "train" / "hidden.npy").is_file()
    log = [json.loads(line) for line in (tmp_path / "whole" / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == [1, 2, 3, 4] and "val_gen_agree" in log[1]


def test_repetition_marks_mark_the_tokens_that_repeat_an_ngram_or_a_run_and_never_a_first_occurrence() -> (
    None
):
    from tools.demo_model.unlikelihood import repetition_marks

    def marked(ids: list[int], ngram: int = 4, run: int = 0) -> list[int]:
        marks = repetition_marks(ids, ngram, run)
        assert marks.shape == (len(ids),)
        return [int(i) for i in np.flatnonzero(marks)]

    # a clause written twice: only the token completing the repeated 4-gram; the tokens between the
    # copies (new 4-grams across the seam) and the one after are first occurrences
    assert marked([1, 2, 3, 4, 1, 2, 3, 4, 5]) == [7]
    # a loop of period 3: from the first 4-gram seen before (index 6) every token repeats
    assert marked([1, 2, 3] * 4) == list(range(6, 12))
    # a 3-gram repeated is not a repeated 4-gram; at ngram=3 it is, from the token that completes it
    assert marked([1, 2, 3, 9, 1, 2, 3, 8]) == []
    assert marked([1, 2, 3, 9, 1, 2, 3, 8], ngram=3) == [6]
    # overlapping occurrences count: six equal tokens repeat the 4-gram from the fifth
    assert marked([7] * 6) == [4, 5]
    # the run rule marks the run-th equal token on, earlier than the n-gram rule
    assert marked([7] * 6, run=3) == [2, 3, 4, 5]
    assert marked([5, 5, 6, 6, 6, 6], run=3) == [4, 5]  # a pair is not a run of 3
    assert marked([5, 5, 6, 6, 6, 6], run=0) == []
    # shorter than an n-gram, and text without repeats
    assert marked([]) == [] and marked([1, 1, 1], run=0) == []
    assert marked(list(range(64)), run=2) == []


def test_the_steps_continuations_mark_repeats_inside_the_continuation_only_and_stop_at_a_stop_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A continuation that copies its prefix is not penalized (copying a prompt is wanted); a repeat inside
    the continuation is; what follows a stop id is neither marked nor counted. The prefixes depend on
    ``(seed, step)`` only."""
    torch = pytest.importorskip("torch")
    from tools.demo_model import unlikelihood
    from tools.demo_model.config import STOP_IDS, DemoConfig

    config = DemoConfig(ul_prefixes=2, ul_prefix=6, ul_min_prefix=6, ul_new_tokens=10, ul_ngram=2, ul_run=0)
    stream = np.arange(100, 1100, dtype=np.uint16)
    prefixes = unlikelihood.prefixes_at(stream, 5, config)
    assert prefixes.shape == (2, 6) and np.all(np.diff(prefixes, axis=1) == 1)
    assert np.array_equal(prefixes, unlikelihood.prefixes_at(stream, 5, config))
    assert not np.array_equal(prefixes, unlikelihood.prefixes_at(stream, 6, config))
    lengths = {unlikelihood.prefixes_at(stream, s, DemoConfig(ul_prefix=8)).shape[1] for s in range(40)}
    assert min(lengths) >= DemoConfig().ul_min_prefix and max(lengths) <= 8 and len(lengths) > 2

    stop = STOP_IDS[0]
    copied = [*prefixes[0].tolist(), 19, 18, 17, 16]  # the prompt again, then new tokens: nothing repeats
    looped = [11, 12, 11, 12, 13, stop, 11, 12, 11, 12]  # (11, 12) again at index 3; after the stop: ignored
    monkeypatch.setattr(unlikelihood, "continue_batch", lambda *a: torch.tensor([copied, looped]))
    batch = unlikelihood.continuations_at(None, stream, 5, config)
    assert batch.prefix_len == 6 and torch.equal(batch.rows[:, :6], torch.from_numpy(prefixes))
    assert batch.marks.tolist() == [[False] * 10, [False, False, False, True] + [False] * 6]
    assert batch.scored.tolist() == [[True] * 10, [True] * 6 + [False] * 4]


def _looping_lm(scale: float = 20.0) -> Any:
    """A tiny untrained causal LM whose greedy output repeats one token, with a probability that grows with
    ``scale`` (8: 0.7-0.97; 20: 1 to float32 precision)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tools.demo_model.config import DemoConfig
    from tools.demo_model.model import DemoModel

    lm = DemoModel(DemoConfig(**TINY, mtp_weight=0.0)).lm.eval()
    with torch.no_grad():
        lm.model.embed_tokens.weight.mul_(scale)
    return lm


def test_batched_continuations_from_the_cache_are_the_greedy_tokens_of_full_forwards() -> None:
    """The stage's batched, cached generation (inside the training's fast kernels) gives each row the tokens
    of a plain full-forward greedy loop; top-k sampling is reproducible from its generator's seed."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tools.demo_model.config import DemoConfig
    from tools.demo_model.evaluate import greedy
    from tools.demo_model.gdn import fast_gated_delta_rule
    from tools.demo_model.model import DemoModel
    from tools.demo_model.unlikelihood import continue_batch

    lm = DemoModel(DemoConfig(**TINY, mtp_weight=0.0)).lm.eval()
    with torch.no_grad():
        for param in lm.parameters():
            if param.ndim == 2:
                param.mul_(6.0)  # beyond the 0.02 init: varied greedy tokens, not one repeated id
    prefixes = torch.randint(3, 4096, (3, 9), generator=torch.Generator().manual_seed(0))
    with fast_gated_delta_rule():
        batched = continue_batch(lm, prefixes, 20)
        sampled = [continue_batch(lm, prefixes, 20, 8, torch.Generator().manual_seed(s)) for s in (1, 1, 2)]
    want = [greedy(lm, row.tolist(), 20) for row in prefixes]
    assert batched.tolist() == want
    assert len({t for row in want for t in row}) > 30
    assert torch.equal(sampled[0], sampled[1]) and not torch.equal(sampled[0], sampled[2])
    assert not torch.equal(sampled[0], batched)


@pytest.mark.parametrize("scale", [8.0, 20.0])
def test_the_unlikelihood_loss_is_minus_log_one_minus_p_of_marked_tokens_and_a_step_lowers_their_p(
    scale: float,
) -> None:
    """The loss is the sum of -log(1 - p) over the marked tokens over the scored ones, and a gradient step on
    it lowers every marked token's probability, also where p rounds to 1 in float32 (``scale`` 20), where
    a naive -log(1 - p) is infinite or, clamped, has no gradient."""
    torch = pytest.importorskip("torch")
    from tools.demo_model.config import DemoConfig
    from tools.demo_model.unlikelihood import continuations_at, unlikelihood_loss

    lm = _looping_lm(scale)
    config = DemoConfig(**TINY, ul_prefixes=3, ul_prefix=8, ul_new_tokens=16)
    stream = np.random.default_rng(0).integers(3, 4096, size=4000).astype(np.uint16)
    batch = continuations_at(lm, stream, 0, config)
    assert int(batch.marks.sum()) > 10 and bool(batch.scored.all())

    def probabilities() -> Any:
        logits = lm(input_ids=batch.rows[:, :-1]).logits[:, batch.prefix_len - 1 :].double()
        return logits.softmax(-1).gather(-1, batch.rows[:, batch.prefix_len :, None]).squeeze(-1)

    with torch.no_grad():
        before = probabilities()
    loss = unlikelihood_loss(lm, batch)
    if scale < 10:
        assert float(before[batch.marks].min()) > 0.5 and float(before[batch.marks].max()) < 0.99
        want = -(1 - before[batch.marks]).log().sum() / batch.marks.numel()
        torch.testing.assert_close(loss.double(), want, rtol=1e-4, atol=1e-6)
    else:
        assert int((before[batch.marks].float() == 1.0).sum()) > 5 and 10 < float(loss.detach()) < 1e3
    loss.backward()
    with torch.no_grad():
        for p in lm.parameters():
            if p.grad is not None:
                p -= 0.05 * p.grad
        after = probabilities()
    assert bool((after[batch.marks] < before[batch.marks]).all())


def _ul_config(**overrides: Any) -> Any:
    from tools.demo_model.config import DemoConfig

    base = {**TINY, "steps": 2, "copy_phase_steps": 0, "unlikelihood_steps": 4, "warmup": 1}
    base.update(eval_every=100, eval_windows=1, mtp_weight=0.0, ul_lr=2e-3, ul_weight=5.0)
    base.update(ul_prefixes=3, ul_prefix=8, ul_min_prefix=4, ul_new_tokens=16)
    return DemoConfig(**{**base, **overrides})


def _looping_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, scale: float = 8.0) -> dict[str, Any]:
    """``init_from`` settings whose warm start is :func:`_looping_lm`'s weights (the stage needs repeats
    with some probability to act on)."""
    from tools.demo_model import warmstart

    state = _looping_lm(scale).state_dict()

    def load(model: Any, config: Any, export_dir: Path, train_ids: np.ndarray) -> dict[str, float]:
        model.lm.load_state_dict(state)
        return {"export_logit_diff": 0.0, "pruned_channels": 0}

    monkeypatch.setattr(warmstart, "init_from_export", load)
    return {"init_from": str(tmp_path / "looping")}


def test_the_unlikelihood_stage_lowers_the_repeats_p_and_with_weight_0_is_plain_mle_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``ul_weight=0`` the stage's steps are those of a copy phase with the same rate and row mix, bit
    for bit (the penalty is the only difference); with a weight, the weights differ and the tokens marked
    in the stage's first continuations are less likely than after the same steps without it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tools.demo_model.evaluate import load_checkpoint
    from tools.demo_model.trainer import train
    from tools.demo_model.unlikelihood import continuations_at

    start = _looping_start(monkeypatch, tmp_path)
    stream = np.random.default_rng(0).integers(3, 4096, size=4000).astype(np.uint16)
    quiet = lambda _: None  # noqa: E731
    config = _ul_config(**start)
    mle = dataclasses.replace(config, ul_weight=0.0)
    same_mix = dataclasses.replace(
        config,
        unlikelihood_steps=0,
        copy_phase_steps=4,
        copy_phase_lr=config.ul_lr,
        copy_phase_window_share=config.copy_window_share,
        copy_phase_random_share=config.random_copy_share,
        copy_phase_quote_share=config.quote_share,
    )
    runs = {
        name: train(c, stream, stream[:200], tmp_path / name, quiet)
        for name, c in (("ul", dataclasses.replace(config, keep_every=2)), ("mle", mle), ("copy", same_mix))
    }
    before, _ = load_checkpoint(tmp_path / "ul" / "step-0000002.pt")  # where the stage started
    first = continuations_at(before, stream, 2, config)  # the stage's first continuations
    assert int(first.marks.sum()) > 5
    assert _same_weights(runs["mle"], runs["copy"])
    assert not _same_weights(runs["ul"], runs["mle"])

    def marked_p(lm: Any) -> Any:
        with torch.no_grad():
            logits = lm(input_ids=first.rows[:, :-1]).logits[:, first.prefix_len - 1 :]
            p = logits.softmax(-1).gather(-1, first.rows[:, first.prefix_len :, None]).squeeze(-1)
        return p[first.marks]

    # from 0.70: the same steps without the penalty leave the repeats about as likely (0.67), with it 0.54
    assert float(marked_p(runs["ul"].lm).mean()) < 0.9 * float(marked_p(runs["mle"].lm).mean())
    assert float(marked_p(runs["mle"].lm).mean()) > 0.5 * float(marked_p(before).mean())
    log = [json.loads(line) for line in (tmp_path / "ul" / "train_log.jsonl").read_text().splitlines()]
    assert [("ul_marked" in e) for e in log] == [False, False, True, True, True, True]
    assert all(0 <= e["ul_marked"] <= 1 and e["ul_loss"] >= 0 for e in log[2:])


def test_a_run_interrupted_in_the_unlikelihood_stage_resumes_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped mid-stage (top-k sampled continuations, whose generator is seeded by (seed, step)) and
    resumed, a run ends with the weights and AdamW state of the uninterrupted run. A checkpoint from before
    the stage resumes under other ``ul_*`` settings (they act on later steps only); one from inside the
    stage is refused."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tools.demo_model.trainer import same_steps_until, train

    start = _looping_start(monkeypatch, tmp_path)
    stream = np.random.default_rng(0).integers(3, 4096, size=4000).astype(np.uint16)
    quiet = lambda _: None  # noqa: E731
    config = _ul_config(**start, ul_top_k=4)
    whole = train(config, stream, stream[:200], tmp_path / "whole", quiet)
    train(config, stream, stream[:200], tmp_path / "split", quiet, until=4)
    shutil.copytree(tmp_path / "split", tmp_path / "inside")
    resumed = train(config, stream, stream[:200], tmp_path / "split", quiet)
    assert _same_weights(resumed, whole)
    assert _same_optimizer_state(tmp_path / "whole", tmp_path / "split") == 6

    other = dataclasses.replace(config, ul_prefix=12, ul_ngram=3)
    assert same_steps_until(dataclasses.replace(config, unlikelihood_steps=0), other, 2)
    assert not same_steps_until(config, other, 3)
    with pytest.raises(RuntimeError, match="other settings"):
        train(other, stream, stream[:200], tmp_path / "inside", quiet)


def test_the_unlikelihood_stage_follows_the_copy_phase_and_its_settings_are_checked() -> None:
    from tools.demo_model.train import _parser, config_from_args
    from tools.demo_model.trainer import learning_rate

    args = ["--steps", "10", "--copy-phase-steps", "5", "--unlikelihood-steps", "3", "--set", "ul_lr=0.0001"]
    cfg = config_from_args(_parser().parse_args(args))
    assert cfg.total_steps == 18 and cfg.unlikelihood_start == 15
    assert [cfg.unlikelihood_at(s) is not None for s in (9, 14, 15, 17)] == [False, False, True, True]
    assert [learning_rate(cfg, s) for s in (14, 15)] == [cfg.copy_phase_lr, 0.0001]
    assert cfg.row_shares(15) == cfg.row_shares(0) != cfg.row_shares(14)  # the main mix, not the copy phase's
    copy_rows = config_from_args(_parser().parse_args([*args, "--set", "ul_rows=copy"]))
    assert copy_rows.row_shares(15) == copy_rows.row_shares(14)
    alone = [
        "--steps",
        "0",
        "--copy-phase-steps",
        "0",
        "--unlikelihood-steps",
        "3",
    ]  # on an --init-from model
    assert config_from_args(_parser().parse_args(alone)).unlikelihood_at(0) is not None
    for bad in (
        "ul_min_prefix=60",
        "ul_new_tokens=1000",
        "ul_ngram=0",
        "ul_run=1",
        "head_only=1",
        "ul_rows=x",
    ):
        with pytest.raises(SystemExit, match="invalid settings"):
            config_from_args(_parser().parse_args([*args, "--set", bad]))


def test_looping_share_counts_rows_that_loop_before_their_first_stop_id() -> None:
    from tools.demo_model.config import STOP_IDS
    from tools.demo_model.evaluate import looping_share

    loops = [5, 6, 7] + [9] * 12  # " string" twelve times
    clean = list(range(10, 40))
    after_stop = [*range(10, 20), STOP_IDS[0], *[9] * 20]  # the loop comes after the stop: never shown
    assert looping_share([loops, clean, after_stop, clean]) == 0.25
    assert looping_share([clean]) == 0.0 and looping_share([loops, loops]) == 1.0


def test_loop_share_is_high_for_a_model_that_repeats_and_the_same_for_the_same_weights() -> None:
    """On :func:`_looping_lm` (greedy output repeats one token) nearly every held-out prompt loops; the
    prompts are seeded, so a second call gives the same share."""
    pytest.importorskip("torch")
    from tools.demo_model.evaluate import loop_share

    stream = np.random.default_rng(0).integers(3, 4096, size=4000).astype(np.uint16)
    lm = _looping_lm(20.0)
    share = loop_share(lm, stream, new_tokens=16)
    assert share > 0.9
    assert loop_share(lm, stream, new_tokens=16) == share
