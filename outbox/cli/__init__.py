"""The ``outbox`` command: each subcommand is thin and calls the modules below.

Exit codes (also in docs/reference/exit-codes.md): 0 ok; 1 failure, or ``status`` found something
that needs attention; 2 usage (a bad option, value or file); 3 PostgreSQL or
RabbitMQ unreachable; 4 database not ready (prepared transactions disabled, schema
missing or too old); 5 schema newer than this version; 6 a wait outlived its
timeout; 130 interrupted (Ctrl-C).

Every error is one line (``error: …`` and maybe ``  hint: …``), or one JSON
object with ``--log-format json``, with every password masked
(``redaction.redact``); never a traceback, except for a bug (exit 1), and then a
redacted one.

One module per command group (``init``, ``relay``, ``resolve``, ``status``,
``deadletters``, ``consume``, ``parked``, ``demo``, ``bench``, ``web``), all built
from the shared options of ``common`` and the option types of ``options``;
``deadletters`` and ``parked`` from the one quarantine's options and output
(``quarantine``).  A
command only parses its options: what a relay or a consumer does with them, from
its endpoints to its summary, is the library's (``outbox.lifecycle``).

May import: every other package (the CLI is the top layer); nothing imports it.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

import click

from outbox import __version__, redaction
from outbox.cli import (
    bench,
    consume,
    deadletters,
    demo,
    init,
    parked,
    relay,
    resolve,
    status,
    web,
)
from outbox.cli.common import report_error, wants_json
from outbox.errors import ExitCode


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, package_name="outbox-relay")
def cli() -> None:
    """Transactional outbox relay: PostgreSQL → RabbitMQ with two-phase commit."""


cli.add_command(init.init)
cli.add_command(relay.relay)
cli.add_command(resolve.resolve)
cli.add_command(status.status)
cli.add_command(deadletters.dead_letters)
cli.add_command(consume.consume)
cli.add_command(parked.parked)
cli.add_command(demo.demo)
cli.add_command(bench.bench)
cli.add_command(web.web)


def main(argv: Sequence[str] | None = None, prog_name: str = "outbox") -> None:
    """Run the command; every error leaves as one line (or JSON object) and its exit code."""
    args = list(argv) if argv is not None else sys.argv[1:]
    try:
        code = cli.main(args=args, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        ctx = exc.ctx if isinstance(exc, click.UsageError) else None
        hint = f"`{ctx.command_path if ctx else prog_name} --help` lists the options and ranges"
        as_json = wants_json(ctx, args)
        report_error(exc.format_message(), hint, code=exc.exit_code, as_json=as_json)
        sys.exit(exc.exit_code)
    except (click.Abort, KeyboardInterrupt):
        # click turns a Ctrl-C into Abort; one outside its main (here, say) stays one.
        report_error(
            "interrupted (Ctrl-C) before the command finished",
            "what it finished stays done; it is safe to run it again for the rest",
            code=int(ExitCode.INTERRUPTED),
            as_json=wants_json(None, args),
        )
        sys.exit(int(ExitCode.INTERRUPTED))
    except BrokenPipeError:
        sys.exit(int(ExitCode.FAILURE))  # stdout closed early (`outbox … | head`)
    except Exception as exc:
        # A bug: keep the traceback for the report, but never a password in it.
        trace = "".join(traceback.format_exception(exc))
        as_json = wants_json(None, args)
        if not as_json:
            click.echo(redaction.redact(trace.rstrip()), err=True)
        report_error(
            f"unexpected {type(exc).__name__}: {exc}",
            "this is a bug in outbox-relay: please report it with the lines above",
            code=int(ExitCode.FAILURE),
            as_json=as_json,
            **({"exception": redaction.redact(trace)} if as_json else {}),
        )
        sys.exit(int(ExitCode.FAILURE))
    sys.exit(code if isinstance(code, int) else 0)
