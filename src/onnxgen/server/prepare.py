"""From a validated request to scheduler jobs: prompt token ids, per-choice SamplingParams, length checks."""

from __future__ import annotations

from collections.abc import Sequence

from onnxgen.errors import GenerationError
from onnxgen.generation.constraints import constraint_from_response_format
from onnxgen.generation.params import SamplingParams
from onnxgen.llm import LLM
from onnxgen.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from onnxgen.server.sequence import Handle, Job, SequenceRun
from onnxgen.tokenizer import Tokenizer

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI default of /v1/completions; chat runs to the context


def check_prompt(ids: Sequence[int], vocab: int, max_model_len: int, which: str = "the prompt") -> None:
    if not ids:
        raise GenerationError(f"{which} is empty; give non-empty text or at least one token id")
    if vocab > 0:
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise GenerationError(
                f"{which} has token ids {bad[:5]} outside the model's vocabulary [0, {vocab}); "
                "encode it with this model's tokenizer"
            )
    if len(ids) >= max_model_len:
        raise GenerationError(
            f"{which} has {len(ids)} tokens but this server's context holds {max_model_len} tokens per "
            "sequence (prompt plus at least one new token); shorten the prompt"
        )


def completion_prompts(llm: LLM, tokenizer: Tokenizer, req: CompletionRequest) -> list[list[int]]:
    out = []
    for prompt in req.prompts():
        if isinstance(prompt, str):
            if not prompt:
                raise GenerationError("the prompt is an empty string; give some text or token ids")
            out.append(tokenizer.encode(prompt))
        else:
            out.append(list(prompt))
    return out


def chat_prompt(llm: LLM, req: ChatCompletionRequest) -> list[int]:
    return llm.chat_prompt([m.as_template_message() for m in req.messages])


def sampling_params(
    fields: SamplingFields, max_tokens: int | None, room: int, seed_offset: int
) -> SamplingParams:
    """The SamplingParams of one choice; ``max_tokens`` is clipped to the ``room`` left in the context."""
    max_new = min(max_tokens if max_tokens is not None else room, room)
    response_format = fields.response_format.model_dump() if fields.response_format else None
    return SamplingParams(
        **constraint_from_response_format(response_format),
        max_new_tokens=max_new,
        temperature=fields.temperature,
        top_k=max(fields.top_k, 0),
        top_p=fields.top_p,
        min_p=fields.min_p,
        repetition_penalty=fields.repetition_penalty,
        presence_penalty=fields.presence_penalty,
        frequency_penalty=fields.frequency_penalty,
        seed=None if fields.seed is None else fields.seed + seed_offset,
        stop=tuple(fields.stop or ()),
        ignore_eos=fields.ignore_eos,
        min_new_tokens=min(fields.min_tokens, max_new),
    )


def make_jobs(
    llm: LLM,
    tokenizer: Tokenizer,
    fields: SamplingFields,
    prompts: list[list[int]],
    max_tokens: int | None,
    max_model_len: int,
    handle: Handle,
) -> list[Job]:
    """One job per prompt, ``n`` choices each; choice ``i`` of prompt ``p`` is index ``p * n + i`` and, with
    a ``seed``, samples with seed ``seed + index``."""
    jobs = []
    for p, prompt in enumerate(prompts):
        which = "the prompt" if len(prompts) == 1 else f"prompt {p}"
        check_prompt(prompt, llm.session.vocab_size, max_model_len, which)
        runs = []
        for i in range(fields.n):
            index = p * fields.n + i
            params = sampling_params(fields, max_tokens, max_model_len - len(prompt), index)
            constraint = llm.generator.constraints.compile(params)  # a bad schema raises here: a 400
            runs.append(SequenceRun(index, prompt, params, llm.eos_token_ids, tokenizer, constraint))
        jobs.append(Job(handle, prompt, runs))
    return jobs
