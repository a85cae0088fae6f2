"""Schema 0004 (ordering keys of any length indexable in the dead letters, a limit
on new rows' keys), by ``manage.py migrate``.

``migrate_schema`` applies whatever ``outbox init`` would, so this is harmless where
``outbox init`` ran first.  Irreversible, as 0001 to 0003.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations


def upgrade_outbox(apps: Any, schema_editor: Any) -> None:
    from outbox.integrations.django import migrate_schema

    migrate_schema(schema_editor.connection)


class Migration(migrations.Migration):
    # Outside a transaction ``migrate_schema`` runs online (docs/how-to/upgrading.md).
    atomic = False
    dependencies = [("outbox", "0003_ordering_keys")]
    operations = [migrations.RunPython(upgrade_outbox, elidable=False)]
