"""Pooling benchmark reports across commands (onnxgen.bench.pool)."""

from __future__ import annotations

import json
import statistics

import pytest

from onnxgen.bench.pool import command_interval, main, markdown_rows, pool

GENAI = "onnxruntime-genai"


def report(model: str, threads: int, prompt: int, pairs, sets=(), tokens=True, other=GENAI) -> dict:
    """A minimal `onnxgen bench --compare --json` report: ``pairs`` of (onnxgen tok/s, other tok/s)."""
    ours = [{"decode_tok_s": a, "ttft_ms": 10.0, "prefill_ms": 9.0} for a, _ in pairs]
    theirs = [{"decode_tok_s": b, "ttft_ms": 20.0, "prefill_ms": 18.0} for _, b in pairs]
    return {
        "model": f"/models/{model}",
        "threads": threads,
        "new_tokens": 128,
        "compare": other,
        "results": [
            {
                "prompt_tokens": prompt,
                "engines": {"onnxgen": {"runs": ours}, other: {"runs": theirs}},
                "tokens_match": tokens,
                "process_decode_ratios": {"onnxgen": list(sets)},
            }
        ],
    }


def test_reports_of_one_cell_pool_their_run_pairs_and_others_stay_apart():
    a = report("m", 2, 16, [(100, 100), (90, 100)], sets=[0.95])
    b = report("m", 2, 16, [(120, 100), (105, 100), (99, 100)], sets=[1.05, 0.99])
    c = report("m", 1, 16, [(50, 100)])
    cells = pool([("a", a), ("b", b), ("c", c)])
    assert [(x.threads, x.commands, x.pairs) for x in cells] == [(2, 2, 5), (1, 1, 1)]
    two = cells[0]
    assert two.decode_ratio() == pytest.approx(statistics.median([1.0, 0.9, 1.2, 1.05, 0.99]))
    assert two.ttft_ratio() == pytest.approx(0.5)
    assert two.worker_sets == [0.95, 1.05, 0.99]


def test_the_interval_resamples_whole_commands():
    # two commands that disagree as wholes: a pair-level bootstrap would sit near 1.0, resampling commands
    # reaches both commands' own levels
    low, high = command_interval([[0.9] * 15, [1.1] * 15], level=0.9)
    assert low == pytest.approx(0.9) and high == pytest.approx(1.1)
    low, high = command_interval([[0.98, 1.0, 1.02]] * 4, level=0.9)
    assert low == pytest.approx(1.0) and high == pytest.approx(1.0)
    assert command_interval([[0.97, 0.99, 1.04]]) == (0.99, 0.99)  # one command: the point
    with pytest.raises(ValueError, match="between 0 and 1"):
        command_interval([[1.0]], level=1.5)


def test_markdown_rows_mark_wins_and_token_mismatches():
    ahead = report("fast", 2, 512, [(110, 100)] * 3)
    behind = report("slow", 2, 16, [(95, 100)] * 3, tokens=False)
    header, rule, *rows = markdown_rows(pool([("x", ahead), ("y", behind)]))
    assert f"{GENAI} decode tok/s" in header and header.count("|") == rule.count("|")
    assert "| fast (2T) | 512 |" in rows[0] and "**1.100x**" in rows[0] and rows[0].endswith("| yes |")
    assert "| 0.950x |" in rows[1] and rows[1].endswith("| no |")
    assert "**0.50x**" in rows[1]  # TTFT below the other engine's is the win


def test_main_reports_unusable_input_clearly(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(report("m", 2, 16, [(100, 100)])))
    assert main([str(good)]) == 0
    assert "| m (2T) | 16 |" in capsys.readouterr().out
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({**report("m", 2, 16, [(1, 1)]), "compare": None}))
    assert main([str(plain)]) == 2
    assert "--compare ENGINE" in capsys.readouterr().err
    uneven = report("m", 2, 16, [(1, 1), (1, 1)])
    uneven["results"][0]["engines"][GENAI]["runs"].pop()
    (tmp_path / "uneven.json").write_text(json.dumps(uneven))
    assert main([str(tmp_path / "uneven.json")]) == 2
    assert "2 onnxgen runs against 1" in capsys.readouterr().err
    partial = report("m", 2, 16, [(1, 1)])
    del partial["threads"]
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    assert main([str(tmp_path / "partial.json")]) == 2
    assert "lacks the field 'threads'" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert main([str(broken)]) == 2
    assert "cannot read" in capsys.readouterr().err
