"""Schema 0009 (messages at a time: scheduled rows and their cancellation),
by ``manage.py migrate``.

``migrate_schema`` applies whatever ``outbox init`` would, so this is harmless where
``outbox init`` ran first.  Irreversible, as 0001 to 0008.
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
    dependencies = [("outbox", "0008_stamped_txid")]
    operations = [migrations.RunPython(upgrade_outbox, elidable=False)]
