"""The crash points answer only the test suite (``outbox/fault_injection.py``)."""

from __future__ import annotations

import os

import pytest

from outbox.fault_injection import SWITCH, SWITCH_ON, armed_from


def test_fault_injection__arms_the_point_with_the_suites_switch() -> None:
    environ = {SWITCH: SWITCH_ON, "OUTBOX_CRASH_AT": "after_prepare:2"}
    assert armed_from(environ) == ("after_prepare", 2)
    assert armed_from({**environ, "OUTBOX_CRASH_AT": "mid_publish"}) == ("mid_publish", 1)


@pytest.mark.parametrize("switch", [None, "", "1", "true", SWITCH_ON.upper()])
def test_fault_injection__ignores_outbox_crash_at_without_the_exact_switch(
    switch: str | None,
) -> None:
    environ = {"OUTBOX_CRASH_AT": "after_claim"}
    if switch is not None:
        environ[SWITCH] = switch
    assert armed_from(environ) == ("", 0)
    # Not even read: a production process does not refuse an unknown point either.
    assert armed_from({**environ, "OUTBOX_CRASH_AT": "nowhere"}) == ("", 0)


def test_fault_injection__refuses_an_unknown_point_with_the_switch() -> None:
    with pytest.raises(SystemExit, match="unknown point 'nowhere'"):
        armed_from({SWITCH: SWITCH_ON, "OUTBOX_CRASH_AT": "nowhere"})


def test_fault_injection__the_suites_plugin_turns_the_switch_on() -> None:
    # What every relay and consumer the suite starts inherits (tests/fixtures/faults.py).
    assert os.environ.get(SWITCH) == SWITCH_ON
