"""The resolver's decision, exhaustively: it is a pure function of plain data."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resolver.decide import Action, Owner, decide, owner_state

ages = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@pytest.mark.parametrize("owner", list(Owner))
@pytest.mark.parametrize("evidence", [True, False, None])
def test_decide__every_owner_and_evidence(owner: Owner, evidence: bool | None) -> None:
    if owner in (Owner.DEAD, Owner.PRESUMED_DEAD) and evidence is None:
        with pytest.raises(ValueError):
            decide(owner, evidence)
        return
    decision = decide(owner, evidence)
    expected = {
        Owner.FOREIGN: Action.SKIP,
        Owner.ALIVE: Action.WAIT,
        Owner.RECONNECTING: Action.WAIT,
        Owner.DEAD: Action.COMMIT if evidence else Action.ROLLBACK,
        Owner.PRESUMED_DEAD: Action.COMMIT if evidence else Action.ROLLBACK,
    }[owner]
    assert decision.action is expected
    assert decision.owner is owner
    assert decision.why


@given(st.sampled_from(list(Owner)), st.sampled_from([True, False]))
def test_decide__commits_only_with_ledger_evidence(owner: Owner, evidence: bool) -> None:
    decision = decide(owner, evidence)
    if decision.action is Action.COMMIT:
        assert evidence is True
        assert owner in (Owner.DEAD, Owner.PRESUMED_DEAD)


@given(st.booleans(), st.one_of(st.none(), ages), ages, st.floats(min_value=1, max_value=1e5))
def test_owner_state__foreign_batches_are_never_anyone_s(
    lock_held: bool, heartbeat_age: float | None, batch_age: float, relay_timeout: float
) -> None:
    owner = owner_state(
        ours=False,
        lock_held=lock_held,
        heartbeat_age=heartbeat_age,
        batch_age=batch_age,
        relay_timeout=relay_timeout,
    )
    assert owner is Owner.FOREIGN
    assert decide(owner, None).action is Action.SKIP


@given(st.one_of(st.none(), ages), ages, st.floats(min_value=1, max_value=1e5))
def test_owner_state__lock_released_on_a_running_server_is_certain_death_at_once(
    heartbeat_age: float | None, batch_age: float, relay_timeout: float
) -> None:
    owner = owner_state(
        ours=True,
        lock_held=False,
        heartbeat_age=heartbeat_age,
        batch_age=batch_age,
        relay_timeout=relay_timeout,
    )
    assert owner is Owner.DEAD


@given(st.one_of(st.none(), ages), ages, st.floats(min_value=1, max_value=1e5))
def test_owner_state__held_lock_waits_for_relay_timeout(
    heartbeat_age: float | None, batch_age: float, relay_timeout: float
) -> None:
    owner = owner_state(
        ours=True,
        lock_held=True,
        heartbeat_age=heartbeat_age,
        batch_age=batch_age,
        relay_timeout=relay_timeout,
    )
    age = heartbeat_age if heartbeat_age is not None else batch_age
    if age < relay_timeout:
        assert owner is Owner.ALIVE
        assert decide(owner, None).action is Action.WAIT
    else:
        assert owner is Owner.PRESUMED_DEAD


@given(st.one_of(st.none(), ages), ages, st.floats(min_value=1, max_value=1e5), ages)
def test_owner_state__lock_gone_with_the_server_waits_relay_timeout_from_its_return(
    heartbeat_age: float | None, batch_age: float, relay_timeout: float, server_age: float
) -> None:
    owner = owner_state(
        ours=True,
        lock_held=False,
        heartbeat_age=heartbeat_age,
        batch_age=batch_age,
        relay_timeout=relay_timeout,
        server_age=server_age,
    )
    assert owner is (Owner.RECONNECTING if server_age < relay_timeout else Owner.DEAD)
    if owner is Owner.RECONNECTING:
        assert decide(owner, None).action is Action.WAIT


@pytest.mark.parametrize("owner", [Owner.DEAD, Owner.PRESUMED_DEAD])
@pytest.mark.parametrize("evidence", [True, False, None])
def test_decide__dead_relay_s_batch_waits_without_its_hand_over_lock(
    owner: Owner, evidence: bool | None
) -> None:
    decision = decide(owner, evidence, handed_over=False)
    assert decision.action is Action.WAIT
    assert "hand-over" in decision.why
