"""Text from rows and messages printed on an operator's terminal (``outbox.terminal``)."""

from __future__ import annotations

import datetime

from hypothesis import given
from hypothesis import strategies as st

from outbox.ops import deadletters, parked
from outbox.terminal import cut, shown


def test_shown__escapes_what_a_terminal_would_act_on() -> None:
    hostile = "id-\x1b]0;owned\x07-\x1b[2J\nerror: fake\r\u202eevil\u2028x\x00\x9b"
    assert shown(hostile) == (
        "id-\\x1b]0;owned\\x07-\\x1b[2J\\nerror: fake\\r\\u202eevil\\u2028x\\x00\\x9b"
    )


def test_shown__leaves_printable_text_as_it_is() -> None:
    text = "ValueError: 'é' \\n is not 「ok」 ✓ (tab-free)"
    assert shown(text) is text


@given(st.text())
def test_shown__prints_one_line_of_printable_characters(text: str) -> None:
    out = shown(text)
    assert out.isprintable() and "\n" not in out
    if text.isprintable():
        assert out == text


def test_cut__says_how_long_the_whole_text_is() -> None:
    assert cut("abc", 3) == "abc"
    assert cut("abc", 12_345) == "abc… (12,345 characters)"
    assert cut(None, None) == ""


def test_render__parked_and_dead_letters_print_hostile_text_escaped_on_its_own_line() -> None:
    when = datetime.datetime(2026, 11, 29, tzinfo=datetime.timezone.utc)
    parked_row = {
        "message_id": "m\x1b[2J",
        "parked_at": when,
        "attempts": 1,
        "queue": "q",
        "exchange": "",
        "routing_key": "q",
        "body_bytes": 1,
        "error": "ValueError: \x1b]0;t\x07\nerror: fake",
        "error_chars": 5000,
    }
    dead_row = {
        "id": 1,
        "message_id": "0b7c",
        "failed_at": when,
        "attempts": 1,
        "exchange": "ex",
        "routing_key": "rk",
        "payload_bytes": 1,
        "ordering_key": None,
        "reason": "routing_key is too long\n    reason: fake",
        "reason_chars": 40,
    }
    for text in (parked.render([parked_row]), deadletters.render([dead_row])):
        assert "\x1b" not in text and "\x07" not in text
        assert len(text.splitlines()) == 2, text
    assert parked.render([parked_row]).endswith("… (5,000 characters)")
