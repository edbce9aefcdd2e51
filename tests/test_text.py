"""Stop strings and UTF-8 across token boundaries, for any split of the text into tokens."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engines.text import StopMatcher, Utf8Stream


def split(data, cuts):
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in points + [len(data)]:
        pieces.append(data[last:p])
        last = p
    return pieces


def run_matcher(stops, pieces):
    m = StopMatcher(tuple(stops))
    out = "".join(m.feed(p) for p in pieces)
    return out + m.flush(), m.stopped, m.matched


@given(st.text(max_size=60), st.lists(st.text(min_size=1, max_size=4), max_size=3), st.lists(st.integers(0, 200), max_size=10))
def test_output_is_text_up_to_first_stop_for_any_split(text, stops, cuts):
    out, stopped, matched = run_matcher(stops, split(text, cuts))
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        # the stop string named (Anthropic's stop_sequence) is one that starts where the text was cut
        assert stopped and out == text[: min(hits)] and matched in stops and text.find(matched) == min(hits)
    else:
        assert not stopped and out == text and matched is None


def test_partial_stop_is_held_then_released():
    m = StopMatcher(("###",))
    assert m.feed("ab#") == "ab"
    assert m.feed("#") == ""
    assert m.feed("c") == "##c"
    assert m.feed("##") == ""
    assert m.feed("#tail") == ""
    assert m.stopped


def test_no_stops_passes_through():
    m = StopMatcher(())
    assert m.feed("abc") == "abc" and m.flush() == ""


@given(st.text(max_size=40), st.lists(st.integers(0, 200), max_size=12))
def test_utf8_split_anywhere_decodes_exactly(text, cuts):
    stream = Utf8Stream()
    out = "".join(stream.feed(piece) for piece in split(text.encode("utf-8"), cuts)) + stream.flush()
    assert out == text


def test_utf8_holds_incomplete_character():
    stream = Utf8Stream()
    euro = "€".encode()
    assert stream.feed(euro[:1]) == ""
    assert stream.feed(euro[1:2]) == ""
    assert stream.feed(euro[2:]) == "€"
    assert stream.feed(b"\xff") == "\ufffd"  # invalid bytes become U+FFFD, never an exception
