"""Schema 0003 (ordering keys), by ``manage.py migrate``.

``migrate_schema`` applies whatever ``outbox init`` would, so this is harmless where
``outbox init`` ran first.  Irreversible, as 0001 and 0002.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations


def upgrade_outbox(apps: Any, schema_editor: Any) -> None:
    from outbox.integrations.django import migrate_schema

    migrate_schema(schema_editor.connection)


class Migration(migrations.Migration):
    # Outside a transaction ``migrate_schema`` runs online (lock_timeout and retries,
    # indexes built concurrently: docs/how-to/upgrading.md); a new migration does the same.
    atomic = False
    dependencies = [("outbox", "0002_dead_letter_ids")]
    operations = [migrations.RunPython(upgrade_outbox, elidable=False)]
