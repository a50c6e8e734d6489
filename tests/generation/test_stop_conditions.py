from __future__ import annotations

import random
import tracemalloc

import pytest

from onnxgen.generation.params import SamplingParams
from onnxgen.generation.stopping import StopChecker, StopMatch, StopStringMatcher, StopStrings


def test_an_eos_token_stops_with_reason_stop() -> None:
    checker = StopChecker(SamplingParams(max_new_tokens=10), eos_ids=[2, 7])
    assert checker.check(5, num_generated=1) is None
    assert checker.check(7, num_generated=2) == "stop"


def test_reaching_max_new_tokens_stops_with_reason_length() -> None:
    checker = StopChecker(SamplingParams(max_new_tokens=3), eos_ids=[2])
    assert checker.check(5, num_generated=2) is None
    assert checker.check(5, num_generated=3) == "length"


def test_eos_on_the_last_allowed_token_reports_stop() -> None:
    assert StopChecker(SamplingParams(max_new_tokens=3), eos_ids=[2]).check(2, num_generated=3) == "stop"


def test_ignore_eos_generates_past_eos() -> None:
    checker = StopChecker(SamplingParams(max_new_tokens=3, ignore_eos=True), eos_ids=[2])
    assert checker.check(2, num_generated=1) is None
    assert checker.check(2, num_generated=3) == "length"


def test_eos_before_min_new_tokens_does_not_stop() -> None:
    checker = StopChecker(SamplingParams(max_new_tokens=8, min_new_tokens=2), eos_ids=[2])
    assert checker.check(2, num_generated=1) is None
    assert checker.check(2, num_generated=2) == "stop"


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], StopMatch]:
    emitted, last = [], StopMatch("", False, None)
    for piece in pieces:
        last = matcher.feed(piece)
        emitted.append(last.text)
    return emitted, last


def test_a_stop_string_split_across_tokens_is_held_back_and_not_emitted() -> None:
    matcher = StopStringMatcher(["STOP"])
    emitted, last = feed_all(matcher, ["Hello S", "T", "OP and more"])
    assert emitted == ["Hello ", "", ""]
    assert last == StopMatch("", True, "stop")
    assert matcher.matched == "STOP"


def test_a_stop_string_inside_one_token_emits_the_text_before_it() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc") == StopMatch("abc", False, None)
    assert matcher.feed("xSTOPdef") == StopMatch("x", True, "stop")


def test_a_held_back_prefix_is_released_once_it_cannot_become_a_stop_string() -> None:
    matcher = StopStringMatcher(["STOP"])
    emitted, last = feed_all(matcher, ["xS", "T", "ay"])
    assert emitted == ["x", "", "STay"]
    assert not last.stopped


def test_a_repeated_prefix_keeps_only_the_part_that_can_still_match() -> None:
    matcher = StopStringMatcher(["abd"])
    emitted, last = feed_all(matcher, ["ab", "ab", "d"])
    assert emitted == ["", "ab", ""]
    assert last.stopped


def test_the_earliest_of_several_stop_strings_wins() -> None:
    matcher = StopStringMatcher(["\n\n", "END"])
    assert matcher.feed("a END b\n\n") == StopMatch("a ", True, "stop")
    assert matcher.matched == "END"


def test_each_of_several_stop_strings_is_held_back_by_its_own_prefix() -> None:
    matcher = StopStringMatcher(["\n\n", "END"])
    emitted, last = feed_all(matcher, ["one\n", "E", "N", "x", "two\n", "\nthree"])
    assert emitted == ["one", "\n", "", "ENx", "two", ""]
    assert last.stopped and matcher.matched == "\n\n"


def test_flush_releases_the_held_tail_when_generation_ends_otherwise() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("the end ST").text == "the end "
    assert matcher.flush() == "ST"
    assert matcher.flush() == ""


def test_nothing_is_emitted_after_a_stop() -> None:
    matcher = StopStringMatcher(["STOP"])
    matcher.feed("aSTOPb")
    assert matcher.feed("more") == StopMatch("", True, "stop")
    assert matcher.flush() == ""


def test_without_stop_strings_text_passes_straight_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == StopMatch("anything", False, None)


def test_empty_stop_strings_are_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


def held_tail(text: str, stops: list[str]) -> int:
    """Brute force: the length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    return max(
        (n for n in range(1, len(text) + 1) for s in stops if len(s) > n and s.startswith(text[-n:])),
        default=0,
    )


def test_streamed_matching_agrees_with_a_brute_force_search_after_every_piece() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        stops = ["".join(rng.choices("ab\n", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
        pieces = ["".join(rng.choices("ab\nc", k=rng.randint(0, 4))) for _ in range(rng.randint(1, 8))]
        matcher, emitted, seen = StopStringMatcher(stops), "", ""
        for piece in pieces:
            seen += piece
            found = [(seen.find(s), i) for i, s in enumerate(stops) if s in seen]
            match = matcher.feed(piece)
            emitted += match.text
            if found:  # the earliest start wins; among stops starting there, the shortest
                start, _ = min(found, key=lambda f: (f[0], len(stops[f[1]])))
                assert match.stopped and emitted == seen[:start], (stops, pieces)
                assert seen.startswith(matcher.matched or "?", start)
                break
            assert not match.stopped and emitted == seen[: len(seen) - held_tail(seen, stops)], (
                stops,
                pieces,
            )
        else:
            assert emitted + matcher.flush() == seen


def test_a_long_stop_string_costs_memory_linear_in_its_length() -> None:
    stops = ["x" * 16_000, "ab" * 8_000, "".join(chr(0x4E00 + i % 5000) for i in range(16_000))]
    total = sum(map(len, stops))
    tracemalloc.start()
    try:
        matcher = StopStringMatcher(stops)
        for _ in range(200):
            matcher.feed("x" * 97 + "a")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # ~250 bytes a character; every prefix of every stop string (quadratic) would take ~10 kB a character
    # here (over 500 MB)
    assert peak < 512 * total, f"{peak / 1e6:.1f} MB for {total} characters of stop strings"
    assert not matcher.stopped and matcher.feed("x" * 16_000).stopped


def test_one_compiled_set_of_stop_strings_serves_independent_matchers() -> None:
    shared = StopStrings(["STOP", "\n\n"])
    first, second = StopStringMatcher(shared), StopStringMatcher(shared)
    assert first.feed("aST") == StopMatch("a", False, None)
    assert second.feed("b\n") == StopMatch("b", False, None)
    assert first.feed("OP") == StopMatch("", True, "stop") and first.matched == "STOP"
    assert second.feed("ST") == StopMatch("\n", False, None)
    assert second.flush() == "ST"
