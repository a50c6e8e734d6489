"""Geometry and training settings of the demo model, and the transformers configs built from them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tools.demo_model.tokenizer import EOS_ID, IM_END_ID, IM_START_ID


@dataclass(frozen=True)
class DemoConfig:
    """Everything that decides the trained weights (with the corpus). Change a field, change the model,
    except the bookkeeping fields (:data:`BOOKKEEPING`), and the schedule's (:data:`SCHEDULE`) where each
    step up to a checkpoint stays the same (:func:`tools.demo_model.trainer.same_steps_until`)."""

    # Qwen3.5 text geometry: layers i % 4 == 3 are full attention, the others Gated DeltaNet.
    # ``dense``: every layer full attention (no recurrent state; the builder exports it with KV caches
    # only), for benchmarks of dense exports beside the hybrid; the bundled model is the hybrid.
    dense: bool = False
    vocab_size: int = 4096
    hidden: int = 192
    intermediate: int = 416  # what fits the bundled files (<= 20 MB fp32) with the MTP head beside them
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    lin_key_heads: int = 2  # Hk < Hv: each key head serves two value heads
    lin_value_heads: int = 4
    lin_head_dim: int = 64
    context_length: int = 1024
    # Qwen3.5 rotates a quarter of each head at theta 1e7; at this size that leaves attention too little
    # position to learn copying within the budget (docs/demo-model.md), so the whole head is rotated.
    partial_rotary: float = 1.0
    rope_theta: float = 10_000.0
    # data
    cut_rate: float = 0.1  # share of training line ends tokenized as a boundary (prompts end there)
    # shares of the main schedule's training rows (the rest are windows of the token stream)
    copy_window_share: float = 0.125  # repeated spans (data.copy_window)
    random_copy_share: float = 0.125  # repeated spans of random ids (data.random_copy_window)
    quote_share: float = 0.125  # one long span recurring (data.quote_window)
    # multi-token prediction: weight of the MTP head's loss (0: no head)
    mtp_weight: float = 0.3
    # training
    # a builder fp32 export of an earlier demo model to start from (tools.demo_model.warmstart; "" trains
    # from a random initialization); its MLP is pruned to ``intermediate`` channels where it is wider
    init_from: str = ""
    # train the MTP head alone on the ``init_from`` model, which stays as it is (its export is reused byte
    # for byte): a head for an existing model at a fraction of a joint step's cost
    head_only: bool = False
    # head_only trains from the frozen decoder's hidden states, computed once over ``head_rows`` training
    # rows (tools.demo_model.headcache); a step is ``head_batch`` crops of ``head_context`` positions
    head_rows: int = 1024
    head_context: int = 256
    head_batch: int = 32
    # the head's target: the decoder's next-token distribution (KL, this weight) and the text's token
    # (cross-entropy, 1 - this weight); greedy speculation accepts the decoder's choice
    head_distill: float = 1.0
    # rows of the decoder's own greedy continuations (``head_new_tokens`` after a ``head_prompt``-token
    # training prompt): what the head reads when it drafts; half of each step's crops when > 0
    head_generated: int = 0
    head_prompt: int = 128
    head_new_tokens: int = 128
    seed: int = 0
    steps: int = 6800
    # then a copy phase at a constant rate: copy-heavy rows sharpen copying of real text (the 4.7M model
    # otherwise lets its own guess override a span it has seen; see docs/demo-model.md)
    copy_phase_steps: int = 1200
    copy_phase_window_share: float = 0.125
    copy_phase_random_share: float = 0.25
    copy_phase_quote_share: float = 0.375  # rows where a long span recurs (data.quote_window)
    quote_span: int = 0  # longest quoted span (0: a third of the row)
    quote_gap: int = 64  # longest gap between copies
    copy_phase_lr: float = 3e-4
    copy_phase_mtp_weight: float = 0.1  # DeepSeek-V3 lowers the MTP weight late in training (0.3 -> 0.1)
    # then an unlikelihood stage at a constant rate (tools.demo_model.unlikelihood; Welleck et al. 2019,
    # sequence level): each step adds to the MLE loss of a main-mix batch ``ul_weight`` times
    # -log(1 - p) of the tokens of the model's own continuations that repeat (greedy, or top-k sampled
    # when ``ul_top_k`` > 1): ``ul_new_tokens`` after each of ``ul_prefixes`` training-text prefixes of
    # ``ul_min_prefix`` to ``ul_prefix`` tokens. Marked: a token completing an ``ul_ngram``-gram already
    # in that continuation, or the ``ul_run``-th token of one token repeated back to back (0: no such rule)
    unlikelihood_steps: int = 0
    ul_lr: float = 3e-4  # the copy phase's rate (and the cooldown's last): no re-warming
    ul_weight: float = 1.0
    ul_prefixes: int = 4
    ul_prefix: int = 48
    ul_min_prefix: int = 4
    ul_new_tokens: int = 64
    ul_ngram: int = 4
    ul_run: int = 3
    ul_top_k: int = 1
    # the MLE rows of an unlikelihood step: the main schedule's mix ("main") or the copy phase's ("copy",
    # more copy rows: the penalty on the model's own repeats also pushes against copying)
    ul_rows: str = "main"
    batch: int = 4
    seq_len: int = 512
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 60
    # "cosine": warmup, then cosine decay from lr to min_lr over the main schedule. "wsd": warmup, lr held
    # constant, then a 1 - sqrt cooldown to min_lr over the last ``decay_steps`` of the main schedule: the
    # steps before the cooldown do not depend on ``steps``, so a long run can be extended, and a cooldown
    # branched off any checkpoint of its constant part (``--resume``)
    schedule: str = "cosine"
    decay_steps: int = 0
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    threads: int = 2  # float reductions depend on it: same threads, same weights
    eval_every: int = 400
    eval_windows: int = 16  # validation windows scored during training (the report scores all)
    checkpoint_every: int = 50  # train/last.pt is rewritten every this many steps (and at evaluations)
    keep_every: int = 0  # also keep train/step-NNNNNNN.pt every this many steps (0: none)

    def __post_init__(self) -> None:
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"schedule={self.schedule!r}: use 'cosine' or 'wsd'")
        if self.schedule == "wsd" and not 0 <= self.decay_steps <= self.steps - self.warmup:
            raise ValueError(
                f"decay_steps={self.decay_steps} must fit between warmup ({self.warmup}) and steps ({self.steps})"
            )
        if self.ul_rows not in ("main", "copy"):
            raise ValueError(f"ul_rows={self.ul_rows!r}: use 'main' or 'copy'")
        if self.unlikelihood_steps:
            if self.head_only:
                raise ValueError("unlikelihood_steps train the decoder: not with head_only")
            if not 1 <= self.ul_min_prefix <= self.ul_prefix:
                raise ValueError(
                    f"ul_min_prefix={self.ul_min_prefix} must be 1 .. ul_prefix ({self.ul_prefix})"
                )
            if self.ul_prefix + self.ul_new_tokens > self.context_length:
                raise ValueError(
                    f"ul_prefix + ul_new_tokens ({self.ul_prefix + self.ul_new_tokens}) exceed the context "
                    f"({self.context_length})"
                )
            if (
                min(self.ul_prefixes, self.ul_new_tokens, self.ul_ngram, self.ul_top_k) < 1
                or self.ul_run == 1
            ):
                raise ValueError(
                    "ul_prefixes, ul_new_tokens, ul_ngram and ul_top_k must be >= 1, ul_run 0 (off) or >= 2"
                )

    @property
    def total_steps(self) -> int:
        return self.steps + self.copy_phase_steps + self.unlikelihood_steps

    @property
    def unlikelihood_start(self) -> int:
        """The first step of the unlikelihood stage (after the main schedule and the copy phase)."""
        return self.steps + self.copy_phase_steps

    def row_shares(self, step: int) -> tuple[float, float, float]:
        """(copy window, random copy, quote window) shares of the rows of training step ``step``: the main
        schedule's mix, or the copy phase's (in the unlikelihood stage, as ``ul_rows`` says)."""
        if step < self.steps or (step >= self.unlikelihood_start and self.ul_rows == "main"):
            return self.copy_window_share, self.random_copy_share, self.quote_share
        return self.copy_phase_window_share, self.copy_phase_random_share, self.copy_phase_quote_share

    def unlikelihood_at(self, step: int) -> tuple[float, int, int, int, int, int, int, int] | None:
        """The unlikelihood settings of training step ``step`` (weight, prefixes, longest and shortest
        prefix, new tokens, n-gram, run, top-k), None before the unlikelihood stage."""
        if step < self.unlikelihood_start:
            return None
        return (
            self.ul_weight,
            self.ul_prefixes,
            self.ul_prefix,
            self.ul_min_prefix,
            self.ul_new_tokens,
            self.ul_ngram,
            self.ul_run,
            self.ul_top_k,
        )

    def mtp_weight_at(self, step: int) -> float:
        """Weight of the MTP head's loss at training step ``step``."""
        return self.mtp_weight if step < self.steps else self.copy_phase_mtp_weight  # copy and UL stages

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def layer_types(self) -> list[str]:
        return [
            "full_attention" if self.dense or i % 4 == 3 else "linear_attention" for i in range(self.layers)
        ]

    def text_config_kwargs(self) -> dict[str, Any]:
        rotary = int(self.head_dim * self.partial_rotary) // 2  # rotary_dim / 2 frequencies
        section = [rotary - 2 * (rotary // 3), rotary // 3, rotary // 3]  # t/h/w; text rows are identical
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.context_length,
            "rms_norm_eps": 1e-6,
            "initializer_range": 0.02,
            "tie_word_embeddings": True,
            "mtp_num_hidden_layers": 1 if self.mtp_weight > 0 else 0,
            "eos_token_id": list(STOP_IDS),
            "pad_token_id": EOS_ID,
            "bos_token_id": IM_START_ID,
            "layer_types": self.layer_types(),
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": self.lin_head_dim,
            "linear_value_head_dim": self.lin_head_dim,
            "linear_num_key_heads": self.lin_key_heads,
            "linear_num_value_heads": self.lin_value_heads,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary,
                "mrope_section": section,
                "mrope_interleaved": True,
            },
        }

    def text_config(self) -> Any:  # -> transformers.Qwen3_5TextConfig
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**self.text_config_kwargs())

    def conditional_config(self) -> Any:  # -> transformers.Qwen3_5Config
        """The text model wrapped as ``Qwen3_5ForConditionalGeneration`` (what the genai builder reads),
        with the smallest vision tower the class accepts (unused: onnxgen exports text only)."""
        from transformers import Qwen3_5Config

        vision = {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": self.hidden,
            "num_position_embeddings": 16,
        }
        config = Qwen3_5Config(
            text_config=self.text_config_kwargs(), vision_config=vision, tie_word_embeddings=True
        )
        config.architectures = ["Qwen3_5ForConditionalGeneration"]
        return config


# Fields that decide no weight: a run may be resumed with other values.
BOOKKEEPING = ("eval_every", "eval_windows", "checkpoint_every", "keep_every")
# Fields that act only through the rate, row mix, MTP weight and unlikelihood settings of each step
# (DemoConfig.learning_rate is in tools.demo_model.trainer, row_shares, mtp_weight_at and unlikelihood_at
# here): a checkpoint resumes under other values when those agree at every step it has done.
SCHEDULE = (
    "steps",
    "copy_phase_steps",
    "schedule",
    "decay_steps",
    "warmup",
    "lr",
    "min_lr",
    "copy_phase_lr",
    "copy_window_share",
    "random_copy_share",
    "quote_share",
    "copy_phase_window_share",
    "copy_phase_random_share",
    "copy_phase_quote_share",
    "mtp_weight",
    "copy_phase_mtp_weight",
    "unlikelihood_steps",
    "ul_lr",
    "ul_weight",
    "ul_prefixes",
    "ul_prefix",
    "ul_min_prefix",
    "ul_new_tokens",
    "ul_ngram",
    "ul_run",
    "ul_top_k",
    "ul_rows",
)

# The ids generation stops at: <|endoftext|> ends a document, <|im_end|> a chat turn.
STOP_IDS = (EOS_ID, IM_END_ID)
