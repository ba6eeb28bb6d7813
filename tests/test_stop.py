"""StopChecker: stop strings are cut wherever the text is split, and no fragment of one leaks."""

from __future__ import annotations

from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserve.engine.stop import StopChecker


def reference_cut(text: str, stops: list[str], include: bool) -> tuple[str, Optional[str]]:
    """The expected result, by brute force: cut at the first position where a stop string ends."""
    for end in range(1, len(text) + 1):
        # On a tie (two stop strings ending at the same place) the longer one wins.
        hits = sorted((s for s in stops if s and text[:end].endswith(s)), key=len, reverse=True)
        if hits:
            return (text[:end] if include else text[: end - len(hits[0])]), hits[0]
    return text, None


def longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def run(pieces: list[str], stops: list[str], include: bool) -> tuple[str, Optional[str]]:
    """Feed the pieces in order, checking after each feed that exactly the safe text was emitted."""
    checker = StopChecker(stops, include)
    emitted, fed = "", ""
    for piece in pieces:
        fed += piece
        out, matched = checker.feed(piece)
        emitted += out
        if matched is not None:
            return emitted, matched
        # Everything is emitted except the longest tail that could still become a stop string.
        held = longest_stop_prefix_suffix(fed, stops)
        assert emitted == fed[: len(fed) - held]
    return emitted + checker.flush(), None


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_no_stop_strings_pass_text_through():
    checker = StopChecker([], False)
    assert checker.feed("hello") == ("hello", None)
    assert checker.flush() == ""


def test_stop_in_one_piece_is_cut_before_it():
    assert StopChecker(["END"], False).feed("abcENDdef") == ("abc", "END")


def test_include_stop_str_in_output_keeps_it():
    assert StopChecker(["END"], True).feed("abcENDdef") == ("abcEND", "END")


def test_stop_split_across_one_char_pieces_never_leaks():
    checker = StopChecker(["</answer>"], False)
    emitted = ""
    for ch in "42</answer>":
        out, matched = checker.feed(ch)
        emitted += out
        assert "<" not in emitted
    assert (emitted, matched) == ("42", "</answer>")


def test_false_start_is_released_once_it_cannot_match():
    checker = StopChecker(["abc"], False)
    assert checker.feed("xab") == ("x", None)
    assert checker.feed("d") == ("abd", None)


def test_flush_releases_held_text_when_sequence_ends_otherwise():
    checker = StopChecker(["###"], False)
    assert checker.feed("done#") == ("done", None)
    assert checker.feed("#") == ("", None)
    assert checker.flush() == "##"
    assert checker.flush() == ""


def test_match_inside_held_text_and_new_piece():
    # "ab" is held as a prefix of "abc"; the new piece completes the shorter "bx" first.
    assert run(["ab", "x"], ["abc", "bx"], False) == ("a", "bx")


def test_earliest_ending_stop_wins_whatever_the_split():
    stops = ["abcd", "bc"]
    assert run(["abcd"], stops, False) == ("a", "bc")
    assert run(list("abcd"), stops, False) == ("a", "bc")


def test_feeding_after_a_match_is_an_error():
    checker = StopChecker(["x"], False)
    checker.feed("x")
    with pytest.raises(RuntimeError):
        checker.feed("y")


def test_empty_stop_strings_are_ignored():
    assert StopChecker([""], False).feed("abc") == ("abc", None)


# Small alphabet so that stop strings, and near misses of them, occur often.
_alphabet = st.sampled_from("ab<>/é")
_stops = st.lists(st.text(_alphabet, min_size=1, max_size=5), min_size=1, max_size=3)


@settings(max_examples=400, deadline=None)
@given(text=st.text(_alphabet, max_size=40), stops=_stops, cuts=st.lists(st.integers(0, 40), max_size=12),
       include=st.booleans())
def test_any_split_gives_the_unsplit_result(text, stops, cuts, include):
    assert run(split(text, cuts), stops, include) == reference_cut(text, stops, include)


@settings(max_examples=200, deadline=None)
@given(text=st.text(_alphabet, max_size=40), stops=_stops, include=st.booleans())
def test_one_char_pieces_give_the_unsplit_result(text, stops, include):
    assert run(list(text), stops, include) == reference_cut(text, stops, include)


def test_a_long_stop_string_costs_linear_time_and_memory():
    # A 40,000-character stop string that the text keeps almost matching: the quadratic checker
    # this replaced built every prefix of it (2.3 GB, seconds of engine time per choice).
    import time
    import tracemalloc

    stop = "a" * 39_999 + "b"
    tracemalloc.start()
    start = time.perf_counter()
    checkers = [StopChecker([stop], False) for _ in range(4)]
    emitted = ["" for _ in checkers]
    for _ in range(500):
        for i, checker in enumerate(checkers):
            emitted[i] += checker.feed("a" * 100)[0]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    elapsed = time.perf_counter() - start
    assert emitted == ["a" * (50_000 - 39_999)] * 4  # the tail that could still become the stop
    assert checkers[0].feed("b") == ("", stop)  # the held tail was the stop string's start
    assert checkers[1].feed("c") == ("a" * 39_999 + "c", None)  # ... or not
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB"
    assert elapsed < 5.0, f"{elapsed:.1f} s"
