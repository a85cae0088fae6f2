"""deploy/ refers only to things that exist: subcommands, OUTBOX_* options, ports, paths.

Compose file, Kubernetes manifests, systemd units, Dockerfile, server settings and
alert rules are parsed and cross-checked against the code (the CLI's options and
commands, the endpoints' paths, the metrics the relay exports).
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import kubernetes_validate
import psycopg
import pytest
import yaml
from click.testing import CliRunner

from outbox import __version__, urls
from outbox.cli import cli
from outbox.config import Settings
from outbox.probes import LIVENESS_PATH, METRICS_PATH, READINESS_PATH
from tests.fixtures import kustomize
from tests.fixtures.pyproject import pyproject

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
KUBERNETES_BASE = KUBERNETES / "base"
CLUSTER = DEPLOY / "cluster"
COMPOSE_FILES = [DEPLOY / "compose.yaml", CLUSTER / "compose.yaml"]
SYSTEMD = DEPLOY / "systemd"
HEALTH_PATHS = {LIVENESS_PATH, READINESS_PATH}
VERSION = __version__
RELAY_IMAGE = f"outbox-relay:{VERSION}"
# deploy/Dockerfile's target consumer-example: the relay image and a handler module.
CONSUMER_IMAGE = f"outbox-consumer-example:{VERSION}"
# Official images the files may use, with the oldest major.minor that works.
# xid8 and gen_random_uuid() need PostgreSQL 13; streams need RabbitMQ 3.9.
THIRD_PARTY_IMAGES = {"postgres": (13, 0), "rabbitmq": (3, 9)}


# -- what the code offers --------------------------------------------------------
def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> Iterator[click.Command]:
    for name, command in group.commands.items():
        yield command
        if isinstance(command, click.Group):
            yield from _commands(command, (*prefix, name))


def cli_envvars() -> set[str]:
    return {
        param.envvar
        for command in _commands(cli)
        for param in command.params
        if isinstance(param.envvar, str)
    }


def assert_real_invocation(args: list[str]) -> None:
    """``outbox <args>`` names a real subcommand with real options."""
    result = CliRunner().invoke(cli, [*args, "--help"])
    assert result.exit_code == 0, (
        f"`outbox {' '.join(args)}` is not a valid command:\n{result.output}"
    )


# -- the files ---------------------------------------------------------------------
def compose(path: Path = DEPLOY / "compose.yaml") -> dict[str, Any]:
    return yaml.safe_load(path.read_text())  # type: ignore[no-any-return]


def compose_services() -> Iterator[dict[str, Any]]:
    """Every service of every compose file."""
    for path in COMPOSE_FILES:
        yield from compose(path)["services"].values()


def manifests() -> list[dict[str, Any]]:
    """The base's resources, as ``kubectl apply -k deploy/kubernetes/base`` sees them."""
    return kustomize.build(KUBERNETES_BASE)


def named(kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in by_kind(kind) if d["metadata"]["name"] == name]
    return doc


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in manifests() if d["kind"] == kind]


def pod_specs() -> Iterator[dict[str, Any]]:
    for doc in manifests():
        spec = doc.get("spec", {})
        if doc["kind"] == "CronJob":
            spec = spec["jobTemplate"]["spec"]
        if "template" in spec:
            yield spec["template"]["spec"]


def configmap_data(name: str = "outbox-config") -> dict[str, str]:
    return named("ConfigMap", name)["data"]  # type: ignore[no-any-return]


def systemd_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections of a unit file as (key, value) lists (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path.name}: cannot parse {raw!r}"
        current.append((key.strip(), value.strip()))
    return sections


def env_file(path: Path) -> dict[str, str]:
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key] = value
    return pairs


def settings_file(path: Path) -> dict[str, str]:
    """``key = value`` lines of postgresql.conf / rabbitmq.conf."""
    pairs = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def every_deploy_file() -> list[Path]:
    """Every text file under deploy/ (the console screenshot is in docs/images)."""
    return [p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix != ".png"]


# -- commands and options ------------------------------------------------------------
def test_deploy__every_outbox_variable_is_a_real_cli_option() -> None:
    from outbox.web import security

    # The console's credentials come from the environment only, never an option.
    known = cli_envvars() | {security.TOKEN_ENV, security.USER_ENV, security.PASSWORD_ENV}
    for path in every_deploy_file():
        used = set(re.findall(r"\bOUTBOX_[A-Z0-9_]+", path.read_text()))
        unknown = used - known
        assert not unknown, f"{path.relative_to(ROOT)} uses unknown settings {sorted(unknown)}"


def test_deploy__settings_fields_are_all_reachable_by_variable() -> None:
    """The other direction: deploy files can set anything a relay can be given."""
    fields = {f"OUTBOX_{name.upper()}" for name in Settings.__dataclass_fields__}
    assert fields <= cli_envvars()


def test_deploy__compose_kubernetes_systemd_and_image_run_real_subcommands() -> None:
    invocations = [
        svc["command"]
        for svc in compose_services()
        if "image" in svc and svc["image"] == RELAY_IMAGE
    ]
    for spec in pod_specs():
        invocations += [
            c["args"] for c in spec["containers"] if c["image"] in (RELAY_IMAGE, CONSUMER_IMAGE)
        ]
    for unit in SYSTEMD.glob("*.service"):
        for key, value in systemd_unit(unit)["Service"]:
            if key in ("ExecStart", "ExecStartPre"):
                executable, *args = shlex.split(value)
                assert executable == "/opt/outbox/bin/outbox"
                invocations.append(args)
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    invocations += [yaml.safe_load(cmd) for cmd in re.findall(r"^CMD (.*)$", dockerfile, re.M)]
    assert len(invocations) >= 15
    for args in invocations:
        assert_real_invocation(args)


# -- ports and probes ------------------------------------------------------------------
@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_deploy__compose_relays_publish_their_metrics_port_and_probe_a_health_path(
    path: Path,
) -> None:
    services = compose(path)["services"]
    relays = {n: s for n, s in services.items() if s.get("command") == ["relay"]}
    assert len(relays) == 2, "the compose file runs two relays"
    host_ports = set()
    for service in relays.values():
        port = service["environment"]["OUTBOX_METRICS_PORT"]
        [mapping] = service["ports"]
        host, container = mapping.split(":")
        assert container == port
        host_ports.add(host)
        [url] = [a for a in service["healthcheck"]["test"][-1].split("'") if a.startswith("http")]
        assert url.startswith(f"http://127.0.0.1:{port}/")
        assert "/" + url.split("/", 3)[3] in HEALTH_PATHS
    assert len(host_ports) == 2


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_deploy__compose_services_files_and_order(path: Path) -> None:
    doc = compose(path)
    services = doc["services"]
    for name, service in services.items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            assert condition["condition"] in (
                "service_healthy",
                "service_completed_successfully",
            )
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency]
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (path.parent / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in doc["volumes"]
        build = service.get("build")
        if build:
            assert (path.parent / build["context"] / build["dockerfile"]).resolve() == (
                DEPLOY / "Dockerfile"
            )
    assert services["outbox-init"]["command"] == ["init"]
    for name, service in services.items():
        if service.get("command") == ["relay"]:
            assert service["depends_on"]["outbox-init"]["condition"] == (
                "service_completed_successfully"
            ), name


def test_deploy__kubernetes_probes_and_ports_match_the_relay() -> None:
    port = int(configmap_data()["OUTBOX_METRICS_PORT"])
    deployment = named("Deployment", "outbox-relay")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    [metrics_port] = container["ports"]
    assert metrics_port["containerPort"] == port
    assert container["livenessProbe"]["httpGet"]["path"] == LIVENESS_PATH
    assert container["readinessProbe"]["httpGet"]["path"] == READINESS_PATH
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == metrics_port["name"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == METRICS_PATH
    service = named("Service", "outbox-relay-metrics")
    assert service["spec"]["ports"][0]["targetPort"] == metrics_port["name"]
    assert (
        service["spec"]["selector"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )


def test_deploy__kubernetes_containers_take_settings_from_the_configmap_and_secret() -> None:
    configmaps = {d["metadata"]["name"]: d["data"] for d in by_kind("ConfigMap")}
    secrets = {d["metadata"]["name"]: d["stringData"] for d in by_kind("Secret")}
    for spec in pod_specs():
        for container in spec["containers"]:
            env: dict[str, str] = {}
            for source in container["envFrom"]:
                if "configMapRef" in source:
                    env |= configmaps[source["configMapRef"]["name"]]
                else:
                    env |= secrets[source["secretRef"]["name"]]
            # Every workload needs both servers; the passwords only from a Secret.
            assert {"OUTBOX_DSN", "OUTBOX_AMQP_URL"} <= env.keys(), container["name"]
            for name in configmaps:
                assert "OUTBOX_DSN" not in configmaps[name] and "TOKEN" not in str(configmaps[name])


def test_deploy__kubernetes_base_lists_every_file_and_its_resources_are_valid() -> None:
    kustomization = yaml.safe_load((KUBERNETES_BASE / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in KUBERNETES_BASE.glob("*.yaml")} - {"kustomization.yaml"}
    for doc in manifests():
        kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_deploy__dockerfile_exposes_the_metrics_port_and_copies_existing_sources() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    port = re.search(r"OUTBOX_METRICS_PORT=(\d+)", text)[1]  # type: ignore[index]
    assert re.search(rf"^EXPOSE {port}$", text, re.M)
    for url in re.findall(r"http://127\.0\.0\.1:(\d+)(/\w+)", text):
        assert url[0] == port and url[1] in HEALTH_PATHS
    readme = pyproject()["project"]["readme"]
    for line in re.findall(r"^COPY (.*)$", text, re.M):
        *sources, _target = line.split()
        for source in sources:
            # The readme is required by pyproject.toml itself, so a checkout has it.
            assert (ROOT / source).exists() or source == readme, f"COPY of missing {source}"


def test_deploy__images_are_the_relay_image_or_pinned_official_ones() -> None:
    images = [s["image"] for s in compose_services()]
    for spec in pod_specs():
        images += [c["image"] for c in spec["containers"]]
    assert RELAY_IMAGE in images and CONSUMER_IMAGE in images
    for image in images:
        if image in (RELAY_IMAGE, CONSUMER_IMAGE):
            continue
        name, _, tag = image.partition(":")
        assert name in THIRD_PARTY_IMAGES, f"unexpected image {image}"
        version = tuple(int(x) for x in re.findall(r"\d+", tag)[:2])
        assert version >= THIRD_PARTY_IMAGES[name], f"{image} is too old"


# -- server settings ---------------------------------------------------------------------
def test_deploy__postgresql_settings_enable_prepared_transactions_and_compose_uses_them() -> None:
    snippet = settings_file(DEPLOY / "postgresql.conf")
    assert int(snippet["max_prepared_transactions"]) >= 2
    command = compose()["services"]["postgres"]["command"]
    flags = dict(arg.split("=", 1) for arg in command if "=" in arg)
    assert flags == snippet


def test_deploy__broker_max_message_size_matches_the_relays_limit() -> None:
    limit = settings_file(DEPLOY / "rabbitmq.conf")["max_message_size"]
    assert int(limit) == Settings().max_message_bytes
    assert configmap_data()["OUTBOX_MAX_MESSAGE_BYTES"] == limit
    assert env_file(SYSTEMD / "outbox.env")["OUTBOX_MAX_MESSAGE_BYTES"] == limit
    for service in compose_services():
        env = service.get("environment", {})
        if "OUTBOX_MAX_MESSAGE_BYTES" in env:
            assert env["OUTBOX_MAX_MESSAGE_BYTES"] == limit


# -- the cluster example -----------------------------------------------------------------
def cluster_services(image: str) -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = compose(CLUSTER / "compose.yaml")["services"]
    return {n: s for n, s in services.items() if s["image"].startswith(f"{image}:")}


def postgres_flags(command: list[str] | str) -> dict[str, str]:
    """The ``-c name=value`` settings of a postgres command line (list or shell text)."""
    words = shlex.split(command.replace("\\\n", " ")) if isinstance(command, str) else command
    return dict(w.split("=", 1) for prev, w in itertools.pairwise(words) if prev == "-c")


def test_deploy__cluster_relays_know_every_rabbitmq_node_and_every_postgres_host() -> None:
    rabbits = cluster_services("rabbitmq")
    postgres = cluster_services("postgres")
    relays = cluster_services("outbox-relay")
    assert len(rabbits) == 3 and len(postgres) == 2
    hostnames = {s["hostname"] for s in rabbits.values()}
    assert hostnames == set(rabbits)  # each node is reachable by its service name
    relay_env = [s["environment"] for s in relays.values() if s["command"] == ["relay"]]
    assert len(relay_env) == 2
    for env in relay_env:
        nodes = urls.parse_amqp_urls(env["OUTBOX_AMQP_URL"])
        assert sorted(n.host for n in nodes) == sorted(hostnames)
        assert {n.port for n in nodes} == {5672}
        conninfo = psycopg.conninfo.conninfo_to_dict(env["OUTBOX_DSN"])
        assert set(str(conninfo["host"]).split(",")) == set(postgres)
        assert conninfo["target_session_attrs"] == "read-write"
        Settings(dsn=env["OUTBOX_DSN"], amqp_url=env["OUTBOX_AMQP_URL"])  # both valid


def test_deploy__cluster_rabbitmq_nodes_form_one_cluster() -> None:
    rabbits = cluster_services("rabbitmq")
    formation = settings_file(CLUSTER / "rabbitmq-cluster.conf")
    assert formation["cluster_formation.peer_discovery_backend"] == "classic_config"
    listed = {v for k, v in formation.items() if k.startswith("cluster_formation.classic_")}
    assert listed == {f"rabbit@{s['hostname']}" for s in rabbits.values()}
    assert len({s["environment"]["RABBITMQ_ERLANG_COOKIE"] for s in rabbits.values()}) == 1
    for name, service in rabbits.items():
        targets = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
        assert targets["/etc/rabbitmq/conf.d/90-outbox.conf"] == "../rabbitmq.conf", name
        assert targets["/etc/rabbitmq/conf.d/91-cluster.conf"] == "./rabbitmq-cluster.conf", name


def test_deploy__cluster_standby_is_synchronous_and_can_take_over_prepared_batches() -> None:
    postgres = cluster_services("postgres")
    primary, standby = postgres["postgres-primary"], postgres["postgres-standby"]
    init = (CLUSTER / "primary-init.sh").read_text()
    [synchronous] = re.findall(r"synchronous_standby_names = '(\w+)'", init)
    assert "/docker-entrypoint-initdb.d/" in " ".join(primary["volumes"])
    [script] = standby["command"]
    assert f"application_name={synchronous}" in script
    assert "pg_basebackup" in script and " -R " in script
    primary_flags = postgres_flags(primary["command"])
    # On the command line the image's set-up server would wait for the standby forever.
    assert "synchronous_standby_names" not in primary_flags
    assert settings_file(DEPLOY / "postgresql.conf").items() <= primary_flags.items()
    standby_flags = postgres_flags(script.split("exec gosu postgres", 1)[1])
    for name in ("max_prepared_transactions", "max_connections"):
        assert int(standby_flags[name]) >= int(primary_flags[name]), name
    # The first write (outbox init) waits for the synchronous standby: start it after.
    init_service = compose(CLUSTER / "compose.yaml")["services"]["outbox-init"]
    assert init_service["depends_on"] == {"postgres-standby": {"condition": "service_healthy"}}
    result = subprocess.run(["sh", "-n", str(CLUSTER / "primary-init.sh")], capture_output=True)
    assert result.returncode == 0, result.stderr
    result = subprocess.run(["bash", "-n", "-c", script.replace("$$", "$")], capture_output=True)
    assert result.returncode == 0, result.stderr


# -- systemd -------------------------------------------------------------------------------
def test_deploy__systemd_units_read_the_env_file_and_the_timer_has_its_service() -> None:
    env = env_file(SYSTEMD / "outbox.env")
    assert {"OUTBOX_DSN", "OUTBOX_AMQP_URL", "OUTBOX_METRICS_PORT"} <= set(env)
    for unit in SYSTEMD.glob("*.service"):
        service = dict(systemd_unit(unit)["Service"])
        assert service["EnvironmentFile"].lstrip("-").startswith("/etc/outbox/")
        assert "/etc/outbox/outbox.env" in [
            v for k, v in systemd_unit(unit)["Service"] if k == "EnvironmentFile"
        ]
    for timer in SYSTEMD.glob("*.timer"):
        assert (SYSTEMD / timer.name.replace(".timer", ".service")).exists()
        assert systemd_unit(timer)["Timer"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_deploy__systemd_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    outbox = sys.executable  # any executable that exists
    units = []
    for unit in sorted(SYSTEMD.glob("*.service")) + sorted(SYSTEMD.glob("*.timer")):
        # Only the install location differs: the check wants an executable that exists.
        copy = tmp_path / unit.name
        copy.write_text(unit.read_text().replace("/opt/outbox/bin/outbox", outbox))
        units.append(str(copy))
    result = subprocess.run(
        ["systemd-analyze", "verify", *units], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


# -- alerts -----------------------------------------------------------------------------------
def exported_metric_names() -> set[str]:
    """Sample names the relay's /metrics would show, with every figure present."""
    from outbox.relay.metrics import DatabaseFigures, RelayCollector
    from outbox.relay.process import Relay

    relay = Relay(Settings())
    database = DatabaseFigures("", "outbox", connect_timeout=1, ttl=3600)
    database._expires = float("inf")  # never query: the figures below are the answer
    database.figures = dict.fromkeys(
        (
            "backlog_rows",
            "oldest_row_age_seconds",
            "prepared_batches",
            "oldest_prepared_age_seconds",
            "dead_letters",
            "dead_letter_ordering_keys",
            "live_relays",
            "dead_rows",
            "horizon_age_seconds",
            "horizon_age_xids",
            "full_pass_age_seconds",
            "full_pass_found_rows",
            "scheduled_rows",
            "scheduled_next_due_seconds",
            "scheduled_overdue_seconds",
        ),
        0,
    )
    return {
        sample.name
        for family in RelayCollector(relay, database).collect()
        for sample in family.samples
    } | consumer_metric_names()


def consumer_metric_names() -> set[str]:
    """Sample names ``outbox consume``'s /metrics would show, parked figure included."""
    from types import SimpleNamespace

    from outbox.inbox.metrics import ConsumerCollector, ParkedFigure
    from outbox.inbox.settings import ConsumerSettings
    from outbox.inbox.stats import ConsumerStats

    settings = ConsumerSettings(queue="q")
    parked = ParkedFigure(settings, ttl=3600)
    parked._expires = float("inf")  # never query: this is the answer
    parked.figures = 0
    inbox = SimpleNamespace(
        settings=settings, stats=ConsumerStats(), broker=SimpleNamespace(connected=True)
    )
    return {
        sample.name
        for family in ConsumerCollector(inbox, parked).collect()  # type: ignore[arg-type]
        for sample in family.samples
    }


# RabbitMQ's own metrics (rabbitmq_prometheus, /metrics/per-object) the consumer's lag
# is read from: outbox consume cannot see what waits in its queue.
RABBITMQ_METRICS = {"rabbitmq_queue_messages_ready"}


def test_deploy__alert_rules_use_only_exported_metrics() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    exported = exported_metric_names()
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert {a["alert"] for a in alerts} >= {
        "OutboxPreparedTransactionStuck",
        "OutboxBacklogStale",
        "OutboxDeadLetters",
        "OutboxNoLiveRelay",
        "OutboxHorizonHeld",
    }
    assert {a["alert"] for a in alerts} >= {
        "OutboxConsumerParkedMessages",
        "OutboxConsumerHandlerFailing",
        "OutboxConsumerSlowEffects",
        "OutboxConsumerLagging",
    }
    for alert in alerts:
        used = {s.name for s in selectors(f"alert {alert['alert']}", alert["expr"])}
        assert used and used <= exported | RABBITMQ_METRICS, (
            f"{alert['alert']}: unknown {used - exported - RABBITMQ_METRICS}"
        )


# -- Grafana dashboard --------------------------------------------------------------------
DASHBOARD = DEPLOY / "grafana" / "outbox-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# What Grafana substitutes before a query reaches Prometheus, with a value of each kind.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__range": "1h",
    "$__interval": "30s",
    "$job": ".*",
    "$queue": ".*",
    "$database": ".*",
}
# The figures the dashboard exists to show (issue 14); every one needs a panel.
DASHBOARD_FIGURES = {
    "outbox_backlog_rows",
    "outbox_backlog_oldest_age_seconds",
    "outbox_messages_published_total",
    "outbox_batch_duration_seconds_bucket",
    "outbox_prepared_batches",
    "outbox_prepared_oldest_age_seconds",
    "outbox_batches_total",
    "outbox_duplicates_possible_total",
    "outbox_dead_letters",
    "outbox_live_relays",
    "outbox_dead_rows",
    "outbox_horizon_age_seconds",
    # The consumer (issue 44): parked, retries, effect latency, and its queue's lag.
    "outbox_consumer_parked_messages",
    "outbox_consumer_handler_failures_total",
    "outbox_consumer_handler_duration_seconds_bucket",
    "rabbitmq_queue_messages_ready",
}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def dashboard_queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    board = dashboard()
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            inner = re.fullmatch(r"label_values\((.+), *\w+\)", query)
            assert inner, f"variable {variable['name']}: unexpected query {query!r}"
            yield f"variable {variable['name']!r}", inner.group(1)


def selectors(where: str, expr: str) -> list[Any]:
    """Parse one query as Prometheus would after Grafana's substitutions."""
    promql_parser = pytest.importorskip("promql_parser")
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"{where}: a Grafana variable this test does not know: {expr}"
    try:
        parsed = promql_parser.parse(expr)
    except ValueError as exc:
        raise AssertionError(f"{where}: invalid PromQL {expr!r}: {exc}") from exc
    found: list[Any] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)

    promql_parser.walk(parsed, visit)
    return found


def test_deploy__dashboard_queries_are_valid_promql_on_exported_metrics_only() -> None:
    exported = exported_metric_names()
    used = set()
    for where, expr in dashboard_queries():
        found = selectors(where, expr)
        names = {selector.name for selector in found}
        known = exported | RABBITMQ_METRICS
        assert found and names <= known, f"{where}: unknown metrics {names - known}"
        used |= names
    assert used >= DASHBOARD_FIGURES, f"no panel shows {DASHBOARD_FIGURES - used}"


def test_deploy__dashboard_panels_filter_by_the_job_variable() -> None:
    """One Prometheus may scrape several outboxes: every panel shows the chosen job(s)."""
    for where, expr in dashboard_queries():
        if where.startswith("variable"):
            continue
        for selector in selectors(where, expr):
            # RabbitMQ's metrics have the broker's job: they filter by $queue instead.
            label = "queue" if selector.name in RABBITMQ_METRICS else "job"
            jobs = [m for m in selector.matchers.matchers if m.name == label]
            assert [m.value for m in jobs] == [".*"], f"{where}: {expr} ignores ${label}"


def test_deploy__dashboard_loads_as_a_grafana_dashboard() -> None:
    board = dashboard()
    assert board["title"] and re.fullmatch(r"[a-z0-9-]{1,40}", board["uid"])
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    assert "id" not in board or board["id"] is None  # Grafana assigns ids on import
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["datasource"] == DATASOURCE

    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    occupied: dict[tuple[int, int], str] = {}
    for panel in board["panels"]:
        assert panel["type"] in {"row", "stat", "timeseries"}, panel["type"]
        grid = panel["gridPos"]
        assert {"x", "y", "w", "h"} <= grid.keys()
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in occupied, f"{panel['title']} overlaps {occupied[x, y]}"
                occupied[x, y] = panel["title"]
        if panel["type"] == "row":
            assert (grid["w"], grid["h"], panel["panels"]) == (24, 1, [])
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
