"""Text from rows and messages, made safe to print on an operator's terminal.

A message id, a handler's error or a dead letter's reason comes from whoever wrote
the row or published the message.  Printed as it is, an escape sequence in it can
retitle the window, clear the screen or rewrite what the operator reads (OSC and CSI
sequences), a newline can start a line of its writer's choosing, and a bidirectional
override can show text in another order than it is.  ``shown`` writes every
character Python does not count as printable (controls, format characters such as
U+202E, line and paragraph separators) as its escape (``\\x1b``, ``\\n``,
``\\u202e``), the way ``repr`` does, and leaves everything else, spaces included,
as it is.
"""

from __future__ import annotations


def shown(text: str) -> str:
    """``text`` with every unprintable character written as its escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def cut(text: str | None, chars: int | None) -> str:
    """A listed text as printed: escaped, and saying how long it is when the list has
    only its beginning."""
    if text is None:
        return ""
    whole = "" if chars is None or chars <= len(text) else f"… ({chars:,} characters)"
    return shown(text) + whole
