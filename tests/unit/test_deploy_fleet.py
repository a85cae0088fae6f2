"""The alerts and the dashboard are per database: every relay metric carries a
``database`` label (a fleet's target, or a single relay's database), so one
database's trouble fires one alert naming it, and the dashboard picks databases."""

from __future__ import annotations

import re
from typing import Any

import yaml

from tests.unit.test_deploy import (
    DEPLOY,
    RABBITMQ_METRICS,
    dashboard,
    dashboard_queries,
    selectors,
)


def relay_metric(name: str) -> bool:
    return name.startswith("outbox_") and not name.startswith("outbox_consumer_")


def relay_alerts() -> list[dict[str, Any]]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    return [
        rule
        for group in rules["groups"]
        for rule in group["rules"]
        if any(relay_metric(s.name) for s in selectors(rule["alert"], rule["expr"]))
    ]


def test_deploy__relay_alerts_aggregate_by_database_and_name_it() -> None:
    alerts = relay_alerts()
    assert len(alerts) >= 9
    for alert in alerts:
        expr = " ".join(alert["expr"].split())
        aggregations = re.findall(r"\b(max|min|sum|avg|count)\s*(by \([^)]*\))?\s*\(", expr)
        # An aggregation without `by (..., database)` would merge the databases of a
        # fleet into one figure (and one alert that names none).
        for op, grouping in aggregations:
            assert "database" in grouping, f"{alert['alert']}: {op} without by (database)"
        assert "{{ $labels.database }}" in alert["annotations"]["summary"], alert["alert"]


def test_deploy__an_idle_fleet_database_without_a_live_relay_is_not_an_alert() -> None:
    """A dormant database's relays unregister until a row comes: no live relay there
    needs attention only while it has rows."""
    [rule] = [a for a in relay_alerts() if a["alert"] == "OutboxNoLiveRelay"]
    assert "outbox_backlog_rows" in rule["expr"] and "absent(outbox_live_relays)" in rule["expr"]


def test_deploy__dashboard_filters_every_relay_metric_by_the_database_variable() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    database = variables["database"]
    assert database["query"]["query"] == 'label_values(outbox_live_relays{job=~"$job"}, database)'
    assert (database["multi"], database["includeAll"], database["allValue"]) == (True, True, ".*")
    for where, expr in dashboard_queries():
        if where.startswith("variable"):
            continue
        for selector in selectors(where, expr):
            if selector.name in RABBITMQ_METRICS or not relay_metric(selector.name):
                continue
            matchers = [m.value for m in selector.matchers.matchers if m.name == "database"]
            assert matchers == [".*"], f"{where}: {expr} ignores $database"
