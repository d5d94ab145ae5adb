"""Leader election and fencing against a real etcd."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator.election import Election, ElectionTiming
from gpupool_sdk.coordinator.fencing import FencedWriter, PutOp
from gpupool_sdk.errors import ConfigError, NotLeaderError
from gpupool_sdk.resources import LeaderRecord
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.codec import decode

TIMING = ElectionTiming(LeaseTiming(ttl_s=3, keepalive_interval_s=0.5, retry_timeout_s=1.0), loop_wait_s=0.5)


@pytest.fixture
def elections(store: EtcdStore) -> Iterator[list[Election]]:
    made: list[Election] = []
    yield made
    for e in made:
        e.resign()


def _election(store: EtcdStore, made: list[Election], name: str, **kw: Any) -> Election:
    e = Election(store, name, TIMING, **kw)
    made.append(e)
    return e


def _leader(store: EtcdStore) -> LeaderRecord | None:
    kv = store.get(store.keys.leader())
    return None if kv is None else decode(kv.key, kv.value, LeaderRecord)


def test_timing_relation_is_validated() -> None:
    lease = LeaseTiming(ttl_s=10, keepalive_interval_s=2, retry_timeout_s=3)
    with pytest.raises(ConfigError, match="loop_wait_s"):
        ElectionTiming(lease, loop_wait_s=5)
    with pytest.raises(ConfigError, match="loop_wait_s"):
        ElectionTiming(lease, loop_wait_s=0)
    assert ElectionTiming(lease, loop_wait_s=4).trust_s == 7


def test_single_candidate_leads_on_its_own_lease(store: EtcdStore, elections: list[Election]) -> None:
    a = _election(store, elections, "coord-a")
    assert a.step() is True
    assert a.is_leader()
    rec = _leader(store)
    assert rec is not None and rec.id == "coord-a" and rec.term == a.term >= 1
    kv = store.get(store.keys.leader())
    assert kv is not None and kv.lease != 0
    info = store.lease_info(kv.lease)
    assert info is not None and store.keys.leader() in info.keys
    assert a.step() is True  # renewal keeps it


def test_two_candidates_exactly_one_leads(store: EtcdStore, elections: list[Election]) -> None:
    a = _election(store, elections, "coord-a")
    b = _election(store, elections, "coord-b")
    results = [a.step(), b.step(), a.step(), b.step()]
    assert results.count(True) == 2  # the winner twice (campaign + renew), the loser never
    assert a.is_leader() != b.is_leader()
    winner = a if a.is_leader() else b
    rec = _leader(store)
    assert rec is not None and rec.id == winner.id


def test_terms_increase_across_leaders(store: EtcdStore, elections: list[Election]) -> None:
    a = _election(store, elections, "coord-a")
    b = _election(store, elections, "coord-b")
    assert a.step()
    t1 = a.term
    assert b.step() is False
    assert a.resign() is True
    assert _leader(store) is None
    assert b.step()
    t2 = b.term
    assert t2 > t1
    b.resign()
    assert a.step()
    assert a.term > t2


def test_deposed_leaders_fenced_write_returns_false_and_demotes(store: EtcdStore, elections: list[Election]) -> None:
    demoted: list[str] = []
    a = _election(store, elections, "coord-a", on_demoted=demoted.append)
    b = _election(store, elections, "coord-b")
    assert a.step()
    writer_a = FencedWriter(store, a.fence, a.demote)
    key = store.keys.usage("probe")
    assert writer_a.write([PutOp(key, b'{"schema":1,"kind":"dict","n":1}')]) is True
    fence_a = a.fence()
    assert fence_a is not None

    # Depose A behind its back: its lease goes (as if it had been partitioned past the TTL).
    kv = store.get(store.keys.leader())
    assert kv is not None
    store.revoke_lease(kv.lease)
    assert b.step() is True

    # A still believes it leads (it has not noticed yet) and tries to write: the fence stops it.
    ok = writer_a.write([PutOp(key, b'{"schema":1,"kind":"dict","n":2}')])
    assert ok is False
    assert demoted, "a lost fence must demote the coordinator"
    assert not a.is_leader()
    got = store.get(key)
    assert got is not None and b'"n":1' in got.value
    with pytest.raises(NotLeaderError):
        writer_a.write([PutOp(key, b"{}")])


def test_renewal_notices_a_lost_leader_key(store: EtcdStore, elections: list[Election]) -> None:
    a = _election(store, elections, "coord-a")
    assert a.step()
    store.delete(store.keys.leader())  # an operator deleted it by hand
    assert a.step() is False
    assert not a.is_leader()
    assert a.step() is True  # and it can campaign again
    assert a.is_leader()


def test_leader_steps_down_before_its_lease_can_expire(store: EtcdStore, elections: list[Election]) -> None:
    now = [1000.0]
    a = _election(store, elections, "coord-a", clock=lambda: now[0])
    assert a.step()
    now[0] += TIMING.trust_s - 0.01
    assert a.is_leader()
    now[0] += 0.02  # no renewal for trust_s = ttl - retry_timeout: stop writing
    assert a.fence() is None
    assert not a.is_leader()


def test_standby_takes_over_when_the_leader_lease_expires(store: EtcdStore, elections: list[Election]) -> None:
    a = _election(store, elections, "coord-a")
    b = _election(store, elections, "coord-b")
    assert a.step()
    term_a = a.term
    # A stops renewing and keeping its lease alive (as if killed): its key vanishes after the TTL.
    keeper = a._keeper
    assert keeper is not None
    keeper.stop(revoke=False)
    a._keeper = None
    deadline = time.monotonic() + 2 * TIMING.lease.ttl_s + 5
    while time.monotonic() < deadline and not b.step():
        time.sleep(0.1)
    assert b.is_leader()
    assert b.term > term_a


def test_leader_steps_down_when_etcd_stops_answering(tmp_path: Any) -> None:
    """A private etcd is frozen (SIGSTOP): renewals fail, and the leader stops trusting itself."""
    import os
    import signal

    from gpupool_sdk.store import EtcdServer, Keyspace

    server = EtcdServer(data_dir=tmp_path / "etcd").start(timeout=60)
    store = EtcdStore(server.endpoint, keyspace=Keyspace("/election-pause"), timeout_s=0.5)
    demoted: list[str] = []
    e = Election(store, "solo", TIMING, on_demoted=demoted.append)
    try:
        assert e.step()
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 4 * TIMING.lease.ttl_s
            while e.is_leader() and time.monotonic() < deadline:
                assert e.step() in (True, False)  # etcd errors are absorbed, never raised
                time.sleep(TIMING.loop_wait_s)
            assert not e.is_leader()
            assert demoted and ("renewal" in demoted[0] or "lease" in demoted[0])
        finally:
            os.kill(server.pid, signal.SIGCONT)
        # etcd is back: the replica can lead again (its old lease is gone or revoked).
        deadline = time.monotonic() + 4 * TIMING.lease.ttl_s
        while not e.step() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert e.is_leader() and e.term >= 2
    finally:
        e.resign()
        store.close()
        server.stop()


def test_a_hand_written_leader_key_does_not_block_elections(store: EtcdStore, elections: list[Election], etcdctl: Any) -> None:
    etcdctl("put", store.keys.leader(), '{"schema": 1, "kind": "LeaderRecord", "id": "ghost", "term": 99}')
    a = _election(store, elections, "coord-a")
    assert a.step() is False  # removes the leaseless key
    assert a.step() is True
    assert a.term >= 1
