"""A job that lost its etcd lease gets its name back by itself (real etcd, real helper process).

The liveness bug behind these tests: after a granted lease was lost (revoked by the pool, expired
or given up by a keepalive step-down on a loaded machine), every later ``acquire`` of the same
name on the same client raised ``JobAlreadyRunningError`` for ever: the client kept the lost
lease as "held", and the helper refused a spec it had written itself for a session that had
ended. The losses are forced through the etcd API (``revoke_lease``) or by writing the state a
step-down leaves behind, so nothing depends on timing.
"""

from __future__ import annotations

import socket
import time

import pytest
from testkit import wait_for

from gpupool_sdk.client import Lease, PoolClient
from gpupool_sdk.client.helper import process_start_ticks
from gpupool_sdk.store import EtcdStore, Put
from gpupool_sdk.store.codec import decode_dict, encode

from .leader_stub import LeaderStub
from .test_pool_client import TIMING, acquire_in_thread, spec


def _granted(pool: PoolClient, leader: LeaderStub, store: EtcdStore, not_on: int = 0) -> Lease:
    """Acquire ``job-a`` and grant it once its spec is on a lease other than ``not_on``."""
    t, out = acquire_in_thread(pool, spec(), timeout=60)

    def submitted() -> bool:
        kv = store.get(store.keys.job_spec("job-a"))
        return kv is not None and kv.lease != not_on

    wait_for(lambda: submitted() or "error" in out, 60, "job-a's spec on a new lease")
    assert "error" not in out, out
    assert leader.grant("job-a")
    t.join(60)
    lease = out.get("lease")
    assert isinstance(lease, Lease), out
    return lease


def test_a_job_whose_lease_was_revoked_acquires_its_name_again(pool: PoolClient, leader: LeaderStub,
                                                                store: EtcdStore) -> None:
    first = _granted(pool, leader, store)
    assert store.revoke_lease(first.etcd_lease_id)  # what a forced preemption does
    wait_for(lambda: first.lost, 30, "the client to see its lease lost")

    # No release() in between: the job re-submits as soon as it notices (was: JobAlreadyRunningError
    # "already held by this client" on every try, for ever).
    second = _granted(pool, leader, store, not_on=first.etcd_lease_id)
    assert second.etcd_lease_id != first.etcd_lease_id and second.active
    assert pool.leases == (second,)  # the lost lease is not listed as held

    first.release()  # late release of the lost lease: a no-op, it must not drop the new one
    assert pool.leases == (second,) and second.active
    kv = store.get(store.keys.job_spec("job-a"))
    assert kv is not None and kv.lease == second.etcd_lease_id
    second.release()
    assert store.get(store.keys.job_spec("job-a")) is None


def test_a_spec_this_helper_left_on_a_live_lease_is_taken_over(pool: PoolClient, leader: LeaderStub,
                                                               store: EtcdStore) -> None:
    # Learn the owner record this client's helper writes (its identity), from a first session.
    first = _granted(pool, leader, store)
    owner_kv = store.get(store.keys.job_owner("job-a"))
    assert owner_kv is not None and owner_kv.lease == first.etcd_lease_id
    owner = decode_dict(owner_kv.key, owner_kv.value)
    assert owner["helper_pid"] == pool.helper_pid and owner["host"] == socket.gethostname()
    assert owner["helper_start"] == process_start_ticks(pool.helper_pid or 0)
    first.release()

    # What a keepalive step-down leaves while its revocation is still under way (or a keeper an
    # interrupted acquire left running): this helper's spec and owner record on a lease that etcd
    # still keeps alive, with no session of the helper on it.
    ks = store.keys
    stale = store.grant_lease(600)
    owner["lease"], owner["at"] = stale, time.time()
    assert store.txn([], [Put(ks.job_spec("job-a"), spec(), stale),
                          Put(ks.job_owner("job-a"), encode(owner, kind="JobOwner"), stale)])

    # Was: JobAlreadyRunningError (the helper and its training process are alive, so the spec
    # looked like another live holder's). Now the helper takes its own leftover over.
    second = _granted(pool, leader, store, not_on=stale)
    assert second.etcd_lease_id != stale
    assert store.lease_info(stale) is None  # revoked by the take-over
    second.release()


def test_another_in_process_helper_still_blocks_the_name(etcd_endpoint: str, leader: LeaderStub,
                                                         store: EtcdStore) -> None:
    """The take-over is for the helper's own leftovers only: two in-process helpers share a pid and
    its start time, yet a live holder in the other one keeps the name."""
    from gpupool_sdk.client import JobAlreadyRunningError

    def client() -> PoolClient:
        return PoolClient(endpoints=etcd_endpoint, prefix=store.keys.prefix, timing=TIMING, node="node-a",
                          in_process=True)

    with client() as a, client() as b:
        held = _granted(a, leader, store)
        with pytest.raises(JobAlreadyRunningError, match=held.etcd_lease_hex):
            b.acquire(spec(), timeout=5)
        assert held.active and store.lease_info(held.etcd_lease_id) is not None
        held.release()
