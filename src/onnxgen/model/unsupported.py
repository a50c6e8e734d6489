"""Exports onnxgen does not run, recognised from their ports before any role is derived.

Each gets one error line that says what the export is and why onnxgen cannot run it, and a fix only
where one exists:

- the decoder of an encoder-decoder model (Whisper, Marian, T5...): it reads the encoder's output
  (``encoder_hidden_states`` or cross-attention caches) that a decoder-only engine never has;
- a decoder fed with ``inputs_embeds`` and no ``input_ids``: the token embedding lives in another model
  (vision-language pipelines split it out);
- onnxruntime-genai's paged-attention export (rank-1 ``input_ids``, ``block_table``,
  ``cumulative_sequence_lengths``): its KV cache is a pool of blocks that onnxgen does not manage; the
  same builder without ``use_paged_attention`` makes an export onnxgen runs.

(Key-only caches are refused where KV pairs are paired: :mod:`onnxgen.model.pairs`.)
"""

from __future__ import annotations

from onnxgen.errors import UnsupportedModelError
from onnxgen.model.graph_ports import GraphSignature

_ENCODER_INPUTS = ("encoder_hidden_states", "encoder_outputs", "encoder_attention_mask", "encoder_output")
_PAGED_INPUTS = ("block_table", "block_tables", "cumulative_sequence_lengths", "slot_mapping")


def check_supported(sig: GraphSignature) -> None:
    """Raise :class:`UnsupportedModelError` for an export of a kind listed in the module docstring."""
    inputs = {p.name: p for p in sig.inputs}
    encoder = [n for n in inputs if n in _ENCODER_INPUTS or ".encoder." in n or "cross" in n.lower()]
    if encoder:
        raise UnsupportedModelError(
            f"this is the decoder of an encoder-decoder model (input '{encoder[0]}' takes the encoder's output); "
            "onnxgen runs decoder-only language models, which need nothing but token ids and their own caches"
        )
    if "inputs_embeds" in inputs and "input_ids" not in inputs:
        raise UnsupportedModelError(
            "this decoder takes 'inputs_embeds' and no 'input_ids': its token embedding is a separate model "
            "(as in vision-language pipelines), and onnxgen feeds token ids to a model that embeds them itself"
        )
    paged = [n for n in inputs if n in _PAGED_INPUTS]
    ids = inputs.get("input_ids")
    if paged or (ids is not None and ids.rank_known and ids.rank == 1 and "attention_mask" not in inputs):
        what = f"input '{paged[0]}'" if paged else "rank-1 'input_ids'"
        raise UnsupportedModelError(
            f"this is a paged-attention export ({what}): its KV cache is a pool of blocks that onnxgen does not "
            "manage; export the model again without paged attention (onnxruntime-genai's builder without "
            "use_paged_attention=true)"
        )
