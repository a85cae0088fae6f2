"""TLS to both servers, as production runs them (issue 9, item 11).

A CA made by the test signs the certificates of a private PostgreSQL (``ssl = on``,
and a pg_hba.conf that accepts TLS connections only) and of a private RabbitMQ
node (a TLS listener next to its plain one).  The relay, ``outbox init`` and the
resolver (which reads the ledger over its own connection) connect with
``amqps://`` + ``--amqp-ca-file`` and ``sslmode=verify-full sslrootcert=…``; a
certificate from another CA, or for another host name, is one clear line and
exit 3.
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator

import pika
import psycopg
import pytest

from outbox.amqp.consumer import Broker, BufferedFrames
from outbox.config import Settings
from outbox.db.devcluster import PostgresCluster, free_port
from outbox.inbox.settings import ConsumerSettings
from tests.acceptance.test_cli import assert_one_clear_error
from tests.fixtures.faults import RabbitNode, RelayProcess, prepared_left, relay_sessions, wait_for
from tests.fixtures.servers import Topology, run_cli, settings_env
from tests.fixtures.tls import CertificateAuthority, rabbitmq_tls_listener

UNREACHABLE = 3


@dataclasses.dataclass(frozen=True)
class TlsServers:
    folder: str
    ca: str  # the CA that signed both servers' certificates
    other_ca: str  # a CA that signed nothing here
    pg_port: int
    amqps_port: int
    plain_amqp_url: str  # the node's plain listener, for the test's own checks

    def dsn(self, ca: str | None = None, host: str = "localhost") -> str:
        return (
            f"host={host} hostaddr=127.0.0.1 port={self.pg_port} user=postgres dbname=postgres "
            f"sslmode=verify-full sslrootcert={ca or self.ca}"
        )

    def amqp_url(self) -> str:
        return f"amqps://guest:guest@localhost:{self.amqps_port}/%2F"


@pytest.fixture(scope="module")
def tls_servers() -> Iterator[TlsServers]:
    folder = tempfile.mkdtemp(prefix="outbox-tls-")
    os.chmod(folder, 0o755)  # PostgreSQL runs as postgres when the tests run as root
    ca = CertificateAuthority(folder, "test-ca")
    other = CertificateAuthority(folder, "other-ca")
    server = ca.server_certificate("server", dns=["localhost"], ips=["127.0.0.1"])
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        for path in (server.cert, server.key):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    hba = os.path.join(folder, "pg_hba.conf")
    with open(hba, "w") as conf:
        conf.write(
            "local all all trust\n"
            "hostssl all all 127.0.0.1/32 trust\n"  # TCP without TLS matches no line
            "hostssl all all ::1/128 trust\n"
        )
    cluster = PostgresCluster(
        durable=False,
        extra_settings={
            "ssl": "on",
            "ssl_cert_file": server.cert,
            "ssl_key_file": server.key,
            "hba_file": hba,
        },
    )
    amqps_port = free_port()
    node = RabbitNode(rabbitmq_tls_listener(amqps_port, ca, server))
    try:
        cluster.start()
        node.start()
        yield TlsServers(folder, ca.cert, other.cert, cluster.port, amqps_port, node.url)
    finally:
        node.destroy()
        cluster.destroy()
        shutil.rmtree(folder, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class TlsCase:
    settings: Settings  # TLS to both servers
    topology: Topology  # the same broker through its plain listener, for the checks


@pytest.fixture
def tls_case(tls_servers: TlsServers) -> Iterator[TlsCase]:
    """This test's names over TLS; its table made by `outbox init` over TLS."""
    suffix = uuid.uuid4().hex[:10]
    topology = Topology(
        tls_servers.plain_amqp_url, f"t.ex.{suffix}", f"t.q.{suffix}", f"t.ledger.{suffix}"
    )
    topology.declare()
    settings = Settings(
        dsn=tls_servers.dsn(),
        amqp_url=tls_servers.amqp_url(),
        amqp_ca_file=tls_servers.ca,
        table=f"tls_{suffix}",
        ledger_queue=topology.ledger,
        batch_size=10,
        poll_interval=0.5,
        heartbeat_interval=0.5,
        relay_timeout=5.0,
        resolve_interval=1.0,
        backoff_initial=0.05,
        backoff_max=0.5,
        connect_timeout=3.0,
    )
    init = run_cli("init", env=settings_env(settings))
    assert init.returncode == 0, init.stderr
    yield TlsCase(settings, topology)
    topology.delete()


def insert(settings: Settings, exchange: str, count: int) -> list[str]:
    with psycopg.connect(settings.dsn) as conn:
        rows = conn.execute(
            f"INSERT INTO {settings.table} (exchange, routing_key, payload) "
            "SELECT %s, 'k', convert_to(i::text, 'UTF8') FROM generate_series(1, %s) i "
            "RETURNING message_id",
            [exchange, count],
        ).fetchall()
    return [str(r[0]) for r in rows]


def test_tls__the_postgresql_server_takes_tls_connections_only(tls_servers: TlsServers) -> None:
    with psycopg.connect(tls_servers.dsn()) as conn:
        assert conn.execute(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
        ).fetchone() == (True,)
    plain = f"host=127.0.0.1 port={tls_servers.pg_port} user=postgres sslmode=disable"
    with pytest.raises(psycopg.OperationalError, match="no encryption"):
        psycopg.connect(plain)


def test_tls__relay_drains_over_amqps_and_verify_full(tls_case: TlsCase) -> None:
    settings, topology = tls_case.settings, tls_case.topology
    sent = insert(settings, topology.exchange, 35)
    # Large bodies go to the TLS socket as views of the claimed payloads.
    with psycopg.connect(settings.dsn) as conn:
        large = {
            bytes([i]) * size: str(
                conn.execute(
                    f"INSERT INTO {settings.table} (exchange, routing_key, payload) "
                    "VALUES (%s, 'k', %s) RETURNING message_id",
                    [topology.exchange, bytes([i]) * size],
                ).fetchone()[0]  # type: ignore[index]
            )
            for i, size in enumerate([3 * 1024 * 1024 + 5, 200_000, 20_000])
        }
    result = run_cli("relay", "--drain", env=settings_env(settings))
    assert result.returncode == 0, result.stderr
    assert "38 published" in result.stderr
    messages = topology.messages()
    assert sorted(str(p.message_id) for _, p, _ in messages) == sorted(sent + list(large.values()))
    assert {body: str(p.message_id) for _, p, body in messages if body in large} == large
    status = run_cli("status", env=settings_env(settings))
    assert status.returncode == 0 and "all good" in status.stdout, status.stdout + status.stderr


def test_tls__resolver_reads_the_ledger_over_amqps(tls_case: TlsCase) -> None:
    settings, topology = tls_case.settings, tls_case.topology
    sent = insert(settings, topology.exchange, 10)
    crashed = RelayProcess(settings, crash_at="before_commit_prepared")
    try:
        assert crashed.wait() == -9, crashed.output()
    finally:
        crashed.close()
    [gid] = prepared_left(settings.dsn)
    wait_for(lambda: relay_sessions(settings.dsn) == 0, 10, "the killed relay's sessions to end")

    result = run_cli("resolve", env=settings_env(settings))

    assert result.returncode == 0, result.stderr
    assert gid in result.stdout and "outcome=committed" in result.stdout, result.stdout
    assert prepared_left(settings.dsn) == []
    assert sorted(str(p.message_id) for _, p, _ in topology.messages()) == sorted(sent)


def test_tls__a_broker_certificate_from_another_ca_is_one_line_and_exit_3(
    tls_servers: TlsServers, tls_case: TlsCase
) -> None:
    env = {**settings_env(tls_case.settings), "OUTBOX_AMQP_CA_FILE": tls_servers.other_ca}
    result = run_cli("relay", "--drain", env=env)
    assert_one_clear_error(result, UNREACHABLE, "certificate verify failed", "--amqp-ca-file")

    env.pop("OUTBOX_AMQP_CA_FILE")  # the system's CAs do not know ours either
    result = run_cli("relay", "--drain", env=env)
    assert_one_clear_error(result, UNREACHABLE, "certificate verify failed")


def test_tls__a_database_certificate_from_another_ca_or_host_is_one_line_and_exit_3(
    tls_servers: TlsServers, tls_case: TlsCase
) -> None:
    for dsn, says in (
        (tls_servers.dsn(ca=tls_servers.other_ca), "certificate verify failed"),
        (tls_servers.dsn(host="wrong.example"), "does not match host name"),
    ):
        env = {**settings_env(tls_case.settings), "OUTBOX_DSN": dsn}
        for command in (["relay", "--drain"], ["init"]):
            result = run_cli(*command, env=env)
            assert_one_clear_error(result, UNREACHABLE, says, "sslrootcert")


def test_tls__an_unreadable_ca_file_is_a_usage_error(
    tls_servers: TlsServers, tls_case: TlsCase
) -> None:
    not_pem = os.path.join(tls_servers.folder, "not-a-ca.pem")
    with open(not_pem, "w") as junk:
        junk.write("not a certificate\n")
    for ca_file, says in ((not_pem, "cannot load CA certificates"), ("/nonexistent", "exist")):
        env = {**settings_env(tls_case.settings), "OUTBOX_AMQP_CA_FILE": ca_file}
        result = run_cli("relay", "--drain", env=env)
        assert_one_clear_error(result, 2, says)


def test_tls__the_consumer_reads_amqps_with_py_amqps_own_reads(
    tls_case: TlsCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over TLS the consumer's buffered frame reader is not installed (it reads a
    plain socket): py-amqp reads, and every delivery arrives whole."""
    topology = tls_case.topology
    ch = topology.channel()
    ch.confirm_delivery()
    bodies = {f"tls-{i}": bytes([i]) * (i * 50_000) for i in range(6)}
    for message_id, body in bodies.items():
        ch.basic_publish(topology.exchange, "k", body, pika.BasicProperties(message_id=message_id))
    ch.connection.close()
    # py-amqp's default TLS context trusts the test's CA through OpenSSL's variable.
    assert tls_case.settings.amqp_ca_file is not None
    monkeypatch.setenv("SSL_CERT_FILE", tls_case.settings.amqp_ca_file)
    url = tls_case.settings.amqp_url
    broker = Broker(ConsumerSettings(queue=topology.queue, dsn="unused", amqp_url=url))
    broker.open()
    try:
        assert broker.conn is not None
        read_frame = broker.conn.connection.transport.read_frame
        assert not isinstance(getattr(read_frame, "__self__", None), BufferedFrames)
        got = []
        deadline = time.monotonic() + 20
        while len(got) < len(bodies) and time.monotonic() < deadline:
            got += broker.drain(timeout=1.0)
        broker.settle(got[-1], ack=True, multiple=True)
    finally:
        broker.close()
    assert {d.message.message_id: d.message.body for d in got} == bodies
