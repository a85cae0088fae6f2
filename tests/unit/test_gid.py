from hypothesis import given
from hypothesis import strategies as st

from outbox import gid as gids

tables = st.from_regex(r"[a-z_][a-z0-9_]{0,40}", fullmatch=True)
relay_ids = st.from_regex(r"[0-9a-f]{32}", fullmatch=True)


@given(tables, relay_ids, st.integers(min_value=0, max_value=2**63))
def test_gid__round_trips(table: str, relay_id: str, seq: int) -> None:
    gid = gids.Gid(table, relay_id, seq)
    assert gids.parse(str(gid)) == gid
    assert len(str(gid)) <= 200  # PostgreSQL's limit for a gid
    assert str(gid).startswith(gids.relay_prefix(table))


@given(relay_ids)
def test_gid__lock_key_fits_int4_and_oid(relay_id: str) -> None:
    assert 0 <= gids.lock_key(relay_id) < 2**31


def test_gid__foreign_prepared_transactions_do_not_parse() -> None:
    for foreign in (
        "",
        "my-app-xid-1",
        "obx:outbox:xyz:1",
        "obx:Outbox:" + "a" * 32 + ":1",
        "obx:outbox:" + "a" * 32 + ":1:extra",
        "_obx:outbox:" + "a" * 32 + ":1",
    ):
        assert gids.parse(foreign) is None


def test_gid__new_relay_ids_are_unique() -> None:
    assert len({gids.new_relay_id() for _ in range(1000)}) == 1000


def test_gid__the_trigger_uses_the_wakeup_lock_class() -> None:
    from importlib import resources

    text = resources.files("outbox.db").joinpath("schema/0005_quiet_wakeups.sql").read_text()
    assert f"pg_try_advisory_lock({gids.WAKEUP_LOCK_CLASS}, TG_RELID::integer)" in text
    assert gids.WAKEUP_LOCK_CLASS != gids.LOCK_CLASS
