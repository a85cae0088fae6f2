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


# -- the fleet's Kubernetes example ------------------------------------------------------
def test_kubernetes__the_fleet_mounts_its_targets_as_a_file_the_relays_read_again() -> None:
    import kubernetes_validate

    from outbox import urls
    from outbox.fleet.targets import parse_targets
    from tests.unit.test_deploy_kubernetes import named, rendered

    docs = rendered("fleet")
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    relay = named(docs, "Deployment", "outbox-fleet-relay")
    assert relay["spec"]["replicas"] == 2  # either keeps every database going
    assert named(docs, "PodDisruptionBudget", "outbox-fleet-relay")["spec"]["maxUnavailable"] == 1
    pod = relay["spec"]["template"]["spec"]
    [container] = pod["containers"]
    config = named(docs, "ConfigMap", "outbox-fleet-config")["data"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    # A subPath mount is never updated: the relays would not see a new list.
    assert "subPath" not in mounts["targets"]
    folder, _, file = config["OUTBOX_TARGETS"].rpartition("/")
    assert mounts["targets"]["mountPath"] == folder
    targets_map = named(docs, "ConfigMap", volumes["targets"]["configMap"]["name"])
    targets = parse_targets(targets_map["data"][file], source=file)
    assert len(targets) == 4 and all("password" not in urls.check_dsn(t.dsn) for t in targets)
    # Passwords come from a libpq password file in the Secret, readable by the relay.
    folder, _, file = config["PGPASSFILE"].rpartition("/")
    assert mounts["pgpass"]["mountPath"] == folder
    secret = volumes["pgpass"]["secret"]
    assert secret["items"] == [{"key": file, "path": file}] and secret["defaultMode"] == 0o640
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_kubernetes__the_fleet_console_reads_the_same_targets_and_is_not_public() -> None:
    from tests.unit.test_deploy_kubernetes import named, rendered

    docs = rendered("fleet")
    assert all(
        d["spec"].get("type", "ClusterIP") == "ClusterIP" for d in docs if d["kind"] == "Service"
    )
    relay = named(docs, "Deployment", "outbox-fleet-relay")["spec"]["template"]["spec"]
    console = named(docs, "Deployment", "outbox-fleet-console")["spec"]["template"]["spec"]
    [container] = console["containers"]
    assert container["args"] == ["web"]
    # The relays' settings (OUTBOX_TARGETS) and the same mounts: the same databases.
    assert {"configMapRef": {"name": "outbox-fleet-config"}} in container["envFrom"]
    assert console["volumes"] == relay["volumes"]
    secrets = [s["secretRef"]["name"] for s in container["envFrom"] if "secretRef" in s]
    assert any("OUTBOX_WEB_TOKEN" in named(docs, "Secret", n)["stringData"] for n in secrets)
