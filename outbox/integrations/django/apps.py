from __future__ import annotations

from django.apps import AppConfig


class OutboxConfig(AppConfig):
    """The outbox schema as a Django app: its migration runs ``outbox init``'s SQL."""

    name = "outbox.integrations.django"
    label = "outbox"
    verbose_name = "Transactional outbox"
