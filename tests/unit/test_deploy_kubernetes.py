"""deploy/kubernetes as a cluster would get it: every overlay rendered
(``tests.fixtures.kustomize``), every resource validated offline, every pod held to
the restricted Pod Security Standard, the KEDA objects checked against what they
scale, and one sizing truth (docs/how-to/operations.md, "Sizing") that every deploy
file, page and hint agrees with.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from outbox.db.queries import scaler_statement
from outbox.web.site import CALLS_AT_ONCE
from tests.fixtures import kustomize

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
FOLDERS = {
    "base": KUBERNETES / "base",
    "example": KUBERNETES / "overlays" / "example",
    "keda": KUBERNETES / "overlays" / "keda",
}
# The fleet (one Deployment of relays for many databases): standalone, held to the
# same rules as every pod (tests/unit/test_deploy_fleet.py checks the rest).
EVERY = {**FOLDERS, "fleet": KUBERNETES / "overlays" / "fleet"}
VERSION = re.search(
    r'^__version__ = "([0-9.]+)"$', (ROOT / "outbox" / "_version.py").read_text(), re.M
)[1]
OPERATIONS = ROOT / "docs" / "how-to" / "operations.md"
# Which Deployment a row of the sizing table sizes.
WORKLOADS = {"outbox-relay": "relay", "outbox-consumer": "consumer", "outbox-console": "console"}


def rendered(name: str) -> list[dict[str, Any]]:
    return kustomize.build(EVERY[name])


def pods(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(resource, pod template) of every workload."""
    for doc in docs:
        spec = doc.get("spec", {})
        if doc["kind"] == "CronJob":
            spec = spec["jobTemplate"]["spec"]
        if "template" in spec:
            yield doc, spec["template"]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


# -- KEDA's two kinds: kubernetes-validate knows no custom resource ---------------------
KEDA_SPEC = {
    "ScaledObject": {
        "scaleTargetRef",
        "minReplicaCount",
        "maxReplicaCount",
        "pollingInterval",
        "cooldownPeriod",
        "advanced",
        "triggers",
    },
    "TriggerAuthentication": {"secretTargetRef"},
}
TRIGGER_METADATA = {
    "postgresql": {"query", "targetQueryValue"},
    "rabbitmq": {"protocol", "mode", "value", "queueName"},
}
AUTH_PARAMETERS = {"postgresql": {"connection"}, "rabbitmq": {"host"}}


def validate_keda(doc: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    """The fields KEDA's CRDs (keda.sh/v1alpha1) define for what we use, and the
    references: the Deployment scaled, the TriggerAuthentication, its Secret key."""
    assert doc["apiVersion"] == "keda.sh/v1alpha1"
    spec = doc["spec"]
    assert set(spec) <= KEDA_SPEC[doc["kind"]], set(spec) - KEDA_SPEC[doc["kind"]]
    if doc["kind"] == "TriggerAuthentication":
        for ref in spec["secretTargetRef"]:
            assert set(ref) == {"parameter", "name", "key"}
            assert ref["key"] in named(docs, "Secret", ref["name"])["stringData"]
        return
    named(docs, "Deployment", spec["scaleTargetRef"]["name"])
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    for trigger in spec["triggers"]:
        metadata = trigger["metadata"]
        assert set(metadata) == TRIGGER_METADATA[trigger["type"]]
        assert all(isinstance(v, str) for v in metadata.values())  # a map of strings
        auth = named(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
        parameters = {ref["parameter"] for ref in auth["spec"]["secretTargetRef"]}
        assert parameters == AUTH_PARAMETERS[trigger["type"]]


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_kubernetes__every_overlay_renders_to_valid_resources(name: str) -> None:
    docs = rendered(name)
    for doc in docs:
        if doc["apiVersion"].startswith("keda.sh/"):
            validate_keda(doc, docs)
        else:
            kubernetes_validate.validate(doc, "1.30.0", strict=True)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for deployment in WORKLOADS:
        assert ("Deployment", deployment) in kinds
        assert ("PodDisruptionBudget", deployment) in kinds
    assert {k for k, _ in kinds} >= {"Job", "CronJob", "Service", "ConfigMap", "Secret"}


@pytest.mark.parametrize("name", sorted(EVERY))
def test_kubernetes__every_pod_meets_the_restricted_pod_security_standard(name: str) -> None:
    for doc, template in pods(rendered(name)):
        where = doc["metadata"]["name"]
        spec = template["spec"]
        assert spec["automountServiceAccountToken"] is False, where
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0, where
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert "hostNetwork" not in spec and "hostPID" not in spec, where
        volumes = spec.get("volumes", [])
        assert all(set(v) - {"name"} <= {"emptyDir", "configMap", "secret"} for v in volumes)
        for container in spec["containers"] + spec.get("initContainers", []):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"] == {"drop": ["ALL"]}, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert "privileged" not in context, where
            resources = container["resources"]
            assert resources["requests"]["memory"] and resources["limits"]["memory"], where


def test_kubernetes__long_running_workloads_have_probes_and_a_disruption_budget() -> None:
    docs = rendered("example")
    for deployment in WORKLOADS:
        doc = named(docs, "Deployment", deployment)
        labels = doc["spec"]["template"]["metadata"]["labels"]
        [container] = doc["spec"]["template"]["spec"]["containers"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert probe in container, (deployment, probe)
        budget = named(docs, "PodDisruptionBudget", deployment)["spec"]
        assert budget["selector"]["matchLabels"].items() <= labels.items()
        assert budget["maxUnavailable"] == 1
    # The relay and the consumer: liveness is the loop going round, readiness the
    # servers; the console has no unauthenticated page, so it is probed by TCP.
    for deployment in ("outbox-relay", "outbox-consumer"):
        [container] = named(docs, "Deployment", deployment)["spec"]["template"]["spec"][
            "containers"
        ]
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert container["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert named(docs, "Deployment", "outbox-relay")["spec"]["replicas"] == 4


def test_kubernetes__the_console_is_not_public_and_takes_its_token_from_a_secret() -> None:
    docs = rendered("example")
    assert not [d for d in docs if d["kind"] == "Ingress"]
    for service in (d for d in docs if d["kind"] == "Service"):
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP", service
    [container] = named(docs, "Deployment", "outbox-console")["spec"]["template"]["spec"][
        "containers"
    ]
    secrets = [s["secretRef"]["name"] for s in container["envFrom"] if "secretRef" in s]
    assert any("OUTBOX_WEB_TOKEN" in named(docs, "Secret", n)["stringData"] for n in secrets)
    assert "OUTBOX_WEB_TOKEN" not in {e["name"] for e in container.get("env", [])}


def test_kubernetes__the_init_job_is_named_for_its_release_and_expires() -> None:
    """A Job's template cannot change: the next release's must be a new Job."""
    [job] = [d for d in rendered("example") if d["kind"] == "Job"]
    assert job["metadata"]["name"] == "outbox-init-" + VERSION.replace(".", "-")
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["image"].endswith(":" + VERSION)
    assert container["args"] == ["init"]
    assert 0 < job["spec"]["ttlSecondsAfterFinished"] <= 7 * 86400


def test_kubernetes__keda_scales_relays_on_the_relays_backlog_statement_never_to_zero() -> None:
    docs = rendered("keda")
    relays = named(docs, "ScaledObject", "outbox-relay")["spec"]
    [trigger] = relays["triggers"]
    assert trigger["type"] == "postgresql"
    assert trigger["metadata"]["query"] == scaler_statement("outbox")
    # Every relay resolves dead relays' batches: at least one must always run.
    assert relays["minReplicaCount"] >= 1
    consumers = named(docs, "ScaledObject", "outbox-consumer")["spec"]
    [trigger] = consumers["triggers"]
    assert trigger["type"] == "rabbitmq"
    config = named(docs, "ConfigMap", "outbox-consumer-config")["data"]
    assert trigger["metadata"]["queueName"] == config["OUTBOX_QUEUE"]
    # KEDA owns the replicas: an overlay that also set them would fight it.
    for deployment in WORKLOADS:
        assert "replicas" not in named(docs, "Deployment", deployment)["spec"] or (
            deployment == "outbox-console"
        )


def test_kubernetes__the_example_handler_is_what_the_consumer_image_runs() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    stage = dockerfile.split("AS consumer-example", 1)[1].split("\nFROM ", 1)[0]
    [handler] = re.findall(r"OUTBOX_HANDLER=(\S+)", stage)
    module, function = handler.split(":")
    [copied] = re.findall(r"^COPY (\S+) ", stage, re.M)
    assert Path(copied).stem == module and (ROOT / copied).exists()
    module_text = (ROOT / copied).read_text()
    assert re.search(rf"^def {function}\(conn: Any, message: Any\)", module_text, re.M)
    assert re.search(r'pip install "\.\[web\]"', dockerfile), "`outbox web` needs the web extra"


# -- one sizing truth ---------------------------------------------------------------------
def sizing_table() -> dict[str, dict[str, str]]:
    """The rows of docs/how-to/operations.md's "Sizing" table, by what they size."""
    section = OPERATIONS.read_text().split("## Sizing", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


def source(path: str) -> str:
    return (ROOT / path).read_text()


def test_sizing__the_table_holds_the_codes_figures() -> None:
    table = sizing_table()
    # Batches in flight: the pipeline's depth (outbox/relay/batches.py).
    depth = r"self\.depth = 2 if settings\.pipeline else 1"
    assert re.search(depth, source("outbox/relay/batches.py"))
    assert table["relay"]["prepared transactions"] == "2"
    # The relay's sessions: work, wake-up, control (liveness) and the metrics'.
    relay = source("outbox/relay/process.py")
    opened = [
        "BatchStore(" in relay,
        re.search(r"WakeupListener\(\s*s\.dsn", relay) is not None,
        "Liveness.start(" in relay,
        "DatabaseFigures(" in source("outbox/relay/metrics.py"),
    ]
    assert all(opened) and table["relay"]["PostgreSQL sessions"] == str(len(opened))
    consumer = [
        "InboxStore(" in source("outbox/inbox/process.py"),
        "InboxStore(" in source("outbox/inbox/metrics.py"),
    ]
    assert all(consumer) and table["consumer"]["PostgreSQL sessions"] == str(len(consumer))
    assert table["console"]["PostgreSQL sessions"] == str(CALLS_AT_ONCE + 1)


def test_sizing__manifests_and_server_settings_follow_the_table() -> None:
    table = sizing_table()
    docs = rendered("keda")
    for deployment, row in WORKLOADS.items():
        [container] = named(docs, "Deployment", deployment)["spec"]["template"]["spec"][
            "containers"
        ]
        assert container["resources"]["requests"]["memory"] == table[row]["memory request"]
        assert container["resources"]["limits"]["memory"] == table[row]["memory limit"]
    for doc, template in pods(docs):
        if doc["kind"] in ("Job", "CronJob"):
            [container] = template["spec"]["containers"]
            assert container["resources"]["limits"]["memory"] == table["job"]["memory limit"]
    most = {
        name: named(docs, "ScaledObject", name)["spec"]["maxReplicaCount"]
        for name in ("outbox-relay", "outbox-consumer")
    }
    server = {}
    for line in (DEPLOY / "postgresql.conf").read_text().splitlines():
        key, sep, value = line.split("#", 1)[0].partition("=")
        if sep and value.strip().isdigit():
            server[key.strip()] = int(value)
    per = {row: {k: int(v) for k, v in c.items() if v.isdigit()} for row, c in table.items()}
    prepared = per["relay"]["prepared transactions"] * most["outbox-relay"]
    sessions = (
        per["relay"]["PostgreSQL sessions"] * most["outbox-relay"]
        + per["consumer"]["PostgreSQL sessions"] * most["outbox-consumer"]
        + per["console"]["PostgreSQL sessions"]
        + per["job"]["PostgreSQL sessions"]
    )
    assert server["max_prepared_transactions"] >= prepared
    assert server["max_connections"] >= sessions + 3  # superuser_reserved_connections
    section = OPERATIONS.read_text().split("## Sizing", 1)[1]
    assert f"needs {prepared} prepared transactions" in section
    assert f"= {sessions} sessions" in section


# Phrases that size the server per relay with a figure other than the table's: one
# prepared transaction per relay ("at least the number of relays", ">= replicas").
PREPARED_ONCE_PER_RELAY = re.compile(
    r"prepared[^.;]{0,200}?(?:(?:>=|≥|at least) (?:the number of )?(?:relays|replicas)\b(?! \u00d7)"
    r"|one prepared-transaction slot)"
)
SESSIONS_PER_RELAY = re.compile(
    r"\b(?P<count>\w+) (?:sessions per relay|per relay \(|sessions: its work)", re.I
)
NUMBERS = {"three": 3, "four": 4, "3": 3, "4": 4, "five": 5, "5": 5}


def sizing_texts() -> Iterator[tuple[str, str]]:
    """Every page, deploy file and hint that may state a per-relay figure, with its
    line breaks and comment marks removed (a statement may span lines)."""
    paths = [
        *(ROOT / "docs").rglob("*.md"),
        *(p for p in DEPLOY.rglob("*") if p.is_file()),
        *(ROOT / "outbox").rglob("*.py"),
        ROOT / "README.md",
    ]
    for path in paths:
        if path.name == "changelog.md":
            continue  # history, not advice
        text = re.sub(r"\n\s*(#|--|\*)?\s*", " ", path.read_text())
        yield str(path.relative_to(ROOT)), text


def test_sizing__every_file_and_hint_agrees_with_the_table() -> None:
    table = sizing_table()
    assert table["relay"]["prepared transactions"] == "2"
    sessions = int(table["relay"]["PostgreSQL sessions"])
    disagreements = []
    for where, text in sizing_texts():
        for match in PREPARED_ONCE_PER_RELAY.finditer(text):
            disagreements.append(f"{where}: {match[0][-120:]!r}")
        for match in SESSIONS_PER_RELAY.finditer(text):
            count = NUMBERS.get(match["count"].lower())
            if count is not None and count != sessions:
                disagreements.append(f"{where}: {match[0]!r}")
    assert not disagreements, "\n".join(disagreements)
