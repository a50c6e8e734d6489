"""Speculative greedy output against plain greedy output on a model, and what exactness costs.

    python scripts/spec_exactness.py MODEL_DIR [--draft DRAFT_DIR] [--threads 2] [--rounds 3]

For each prompt (a short story; a rename-a-variable edit of textwrap.dedent's source) and each proposer
(prompt lookup; a draft model with --draft), runs 200 greedy tokens plainly, speculatively with the
default ``exact_speculation`` (speculation only where the probed verify is exact) and speculatively with
``exact_speculation=False``; prints the first position where each differs from plain decoding and the
decode tok/s medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import textwrap

import onnxgen
from onnxgen import DraftModel, PromptLookup
from onnxgen.runtime.verify_check import check_verify

STORY = [
    {
        "role": "user",
        "content": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    }
]


def edit_messages() -> list[dict[str, str]]:
    source = inspect.getsource(textwrap.dedent)
    return [
        {"role": "user", "content": f"Rename the variable `margin` to `prefix` in this code:\n\n{source}"}
    ]


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
        None if len(a) == len(b) else min(len(a), len(b)),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--draft")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--draft-tokens", type=int, default=4)
    args = p.parse_args()
    plain_llm = onnxgen.load(args.model, threads=args.threads)  # never speculates: the graph as prepared
    exact = onnxgen.load(args.model, threads=args.threads)
    loose = onnxgen.load(args.model, threads=args.threads, exact_speculation=False)
    print("probe on the graph as prepared:", check_verify(plain_llm.session))
    proposers = {"prompt-lookup": PromptLookup(num_draft_tokens=args.draft_tokens)}
    if args.draft:
        proposers["draft"] = DraftModel(args.draft)
    for name, messages in (("story", STORY), ("code-edit", edit_messages())):
        kw = {"max_new_tokens": args.tokens, "temperature": 0}
        plain = plain_llm.chat(messages, **kw)
        for pname, spec in proposers.items():
            rates: dict[str, list[float]] = {"plain": [], "exact": [], "loose": []}
            diffs, drafts = {}, {}
            for _ in range(args.rounds):
                for label, llm, sp in (
                    ("plain", plain_llm, None),
                    ("exact", exact, spec),
                    ("loose", loose, spec),
                ):
                    res = llm.chat(messages, speculative=sp, **kw)
                    rates[label].append(res.stats["decode_tok_s"])
                    diffs[label] = first_diff(plain.token_ids, res.token_ids)
                    drafts[label] = (
                        res.stats.get("accepted_draft_tokens"),
                        res.stats.get("proposed_draft_tokens"),
                    )
            med = {k: statistics.median(v) for k, v in rates.items()}
            print(
                f"{name:9s} {pname:13s} first diff: exact {diffs['exact']}, loose {diffs['loose']}; accepted/proposed "
                f"exact {drafts['exact']}, loose {drafts['loose']}; decode tok/s plain {med['plain']:.1f}, exact "
                f"{med['exact']:.1f} ({med['exact'] / med['plain']:.2f}x), loose {med['loose']:.1f} "
                f"({med['loose'] / med['plain']:.2f}x)"
            )


if __name__ == "__main__":
    main()
