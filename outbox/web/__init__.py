"""The operator's console in the browser (``outbox web``, the ``web`` extra).

Owns the web application (``app``: Starlette, Jinja2 templates, htmx as a
vendored static file) and its routes by resource (``overview``; ``quarantine``: dead
letters and parked messages; ``indoubt``: in-doubt batches) over what every page
shares (``site``: rendering, blocking calls, the request guard, form checks, the
audit log), what it reads and does (``console``: the same store, parked
and resolver calls as the CLI), who may use it and the CSRF rules (``security``),
the last hour's samples shared by every tab (``sampler``) and their charts drawn as
inline SVG (``charts``), the console of many databases (``fleet``: an overview of
all of them, each one's pages under ``/db/<name>/``), and serving it (``server``:
uvicorn).  The click command is ``outbox.cli.web``.

May import: ``outbox.ops``, ``outbox.fleet``, ``outbox.inbox``, ``outbox.relay``, ``resolver``,
``outbox.db`` and the plain modules of ``outbox``; only ``outbox.cli`` imports it.

Public names: ``app.create_app``, ``app.WebConfig``, ``console.ConsoleConfig``,
``console.InboxTarget``, ``server.serve``.  This module imports nothing itself, so
the CLI can name ``security``'s settings without Starlette installed.
"""
