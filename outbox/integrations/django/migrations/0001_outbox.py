"""The outbox schema, created by ``manage.py migrate``.

It runs ``outbox.db.migrate`` (what ``outbox init`` runs), which skips what is already
applied, so it is harmless on a database that ``outbox init`` set up first. Django
records a migration once, so every new ``outbox/schema/NNNN_*.sql`` needs a Django
migration of its own that runs ``migrate_schema`` again (a test counts them).

Irreversible on purpose: the tables may hold committed messages not yet published.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations


def create_outbox(apps: Any, schema_editor: Any) -> None:
    from outbox.integrations.django import migrate_schema

    migrate_schema(schema_editor.connection)


class Migration(migrations.Migration):
    # Outside a transaction ``migrate_schema`` runs online (lock_timeout and retries,
    # indexes built concurrently: docs/how-to/upgrading.md); a new migration does the same.
    atomic = False
    initial = True
    dependencies = []
    operations = [migrations.RunPython(create_outbox, elidable=False)]
