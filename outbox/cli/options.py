"""The CLI's option types: a bad value is a usage error (exit 2) before anything connects.

Numbers take their range from ``config.LIMITS`` (``Settings`` checks the same), the
connection settings are checked by ``urls`` and their passwords remembered by
``redaction`` before anything can print them.  ``--help`` shows each range.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import click

from outbox import redaction, urls
from outbox.config import LEDGER_MAX_AGE, LIMITS, Settings, queue_name_problem

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}

if TYPE_CHECKING:
    _TextType = click.ParamType[str]
else:  # older click releases have no generic ParamType
    _TextType = click.ParamType


# A list's --limit: at least one row, at most what PostgreSQL's LIMIT takes as an
# integer without an error of its own.
LIST_LIMIT = click.IntRange(1, 2**31 - 1)


class FiniteFloatRange(click.FloatRange):
    """``click.FloatRange`` that also refuses ``nan`` (which passes every comparison)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def limited(field: str) -> click.ParamType[Any]:
    """The option type of a ``Settings`` number: its range from ``config.LIMITS``."""
    limit = LIMITS[field]
    if isinstance(_DEFAULTS[field], int):
        return click.IntRange(int(limit.low), int(limit.high))
    return FiniteFloatRange(limit.low, limit.high, min_open=limit.above)


class DsnType(_TextType):
    name = "dsn"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        redaction.remember(text)  # before anything can print it
        try:
            urls.check_dsn(text)
        except urls.InvalidUrl as exc:
            redaction.remember(text, refused=True)
            self.fail(str(exc), param, ctx)
        return text


class AmqpUrlType(_TextType):
    name = "url[;url…]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        redaction.remember(text)  # before anything can print it
        try:
            urls.parse_amqp_urls(text)
        except urls.InvalidUrl as exc:
            redaction.remember(text, refused=True)
            self.fail(str(exc), param, ctx)
        return text


class LedgerMaxAge(_TextType):
    name = "age"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not LEDGER_MAX_AGE.match(str(value)):
            self.fail(
                f"{value!r} is not a RabbitMQ x-max-age: a whole number and one unit of "
                "Y, M, D, h, m, s (e.g. 7D, 12h)",
                param,
                ctx,
            )
        return value


class QueueName(_TextType):
    """A name RabbitMQ accepts for a queue (also the consumer name the inbox records)."""

    name = "queue"

    def __init__(self, what: str = "queue name", *, declared: bool = True) -> None:
        self.what = what
        self.declared = declared

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        problem = queue_name_problem(value, declared=self.declared)
        if problem:
            self.fail(f"the {self.what} {problem}", param, ctx)
        return value


def age_text(seconds: float) -> str:
    """``seconds`` as an ``Age`` option's text: in days, hours or minutes, the
    largest that divides it, else seconds (``604800.0`` -> ``7d``; pure)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


class Age(_TextType):
    """``30d``, ``12h``, ``900s``: seconds, at most ``MAX_AGE`` (SQL intervals overflow)."""

    name = "age"
    MAX_AGE = 100 * 365 * 86400.0

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from outbox.ops.deadletters import parse_age

        try:
            seconds = parse_age(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        if seconds > self.MAX_AGE:
            self.fail(f"{value!r} is more than 100 years", param, ctx)
        return value
