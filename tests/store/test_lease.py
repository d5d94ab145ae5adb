"""LeaseKeeper and LeaseTiming against a real etcd."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from testkit import wait_for

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.errors import ConfigError, GpupoolError, LeaseLostError, StoreUnavailableError
from gpupool_sdk.store import EtcdServer, EtcdStore, Keyspace, LeaseKeeper

FAST = LeaseTiming(ttl_s=3, keepalive_interval_s=0.5, retry_timeout_s=1.0)


class Lost:
    def __init__(self) -> None:
        self.reasons: list[GpupoolError] = []
        self.threads: list[str] = []
        self.event = threading.Event()

    def __call__(self, reason: GpupoolError) -> None:
        self.reasons.append(reason)
        self.threads.append(threading.current_thread().name)
        self.event.set()


# ---------------------------------------------------------------- LeaseTiming


def test_timing_defaults_are_valid() -> None:
    t = LeaseTiming()
    assert (t.ttl_s, t.keepalive_interval_s, t.retry_timeout_s) == (10.0, 2.0, 3.0)
    assert t.step_down_after_s == 8.0


def test_timing_rounds_ttl_up_to_whole_seconds() -> None:
    assert LeaseTiming(ttl_s=2.2, keepalive_interval_s=0.2, retry_timeout_s=0.5).ttl_whole_s == 3


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"ttl_s": 10, "keepalive_interval_s": 5, "retry_timeout_s": 3}, "ttl_s", "keepalive_interval_s + 2 * retry_timeout_s"),
        ({"ttl_s": 1}, "ttl_s", "at least 2"),
        ({"ttl_s": 0}, "ttl_s", "> 0"),
        ({"keepalive_interval_s": -1}, "keepalive_interval_s", "> 0"),
        ({"retry_timeout_s": "3"}, "retry_timeout_s", "number of seconds"),
    ],
)
def test_timing_validation_names_fields_and_fix(kwargs: dict, field: str, fragment: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError) as info:
        LeaseTiming(**kwargs)
    assert info.value.field == field and fragment in str(info.value)


def test_timing_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPOOL_LEASE_TTL", "20")
    assert LeaseTiming.from_env().ttl_s == 20.0
    monkeypatch.setenv("GPUPOOL_LEASE_TTL", "soon")
    with pytest.raises(ConfigError, match="GPUPOOL_LEASE_TTL"):
        LeaseTiming.from_env()


# ---------------------------------------------------------------- LeaseKeeper


def test_keeper_keeps_the_lease_beyond_its_ttl(store: EtcdStore) -> None:
    lost = Lost()
    keeper = LeaseKeeper(store, FAST, on_lost=lost)
    lease = keeper.start()
    key = store.keys.node("kept")
    store.put(key, b"x", lease=lease)
    # More refreshes than fit in one TTL: without them the key would be gone.
    wait_for(lambda: keeper.refreshes >= 2 * int(FAST.ttl_s / FAST.keepalive_interval_s))
    assert store.get(key) is not None and not lost.reasons
    keeper.stop(revoke=True)
    assert store.get(key) is None and store.lease_info(lease) is None
    assert not lost.reasons  # a deliberate stop is not a loss


def test_external_revoke_fires_on_lost_once_from_keeper_thread(store: EtcdStore) -> None:
    lost = Lost()
    keeper = LeaseKeeper(store, FAST, on_lost=lost)
    lease = keeper.start()
    store.revoke_lease(lease)
    assert lost.event.wait(30)
    time.sleep(2 * FAST.keepalive_interval_s)  # a second call would have happened by now
    assert len(lost.reasons) == 1 and isinstance(lost.reasons[0], LeaseLostError)
    assert lost.threads[0].startswith("gpupool-lease")
    assert keeper.lost
    keeper.stop()


def test_adopts_an_existing_lease(store: EtcdStore) -> None:
    lease = store.grant_lease(FAST.ttl_s)
    keeper = LeaseKeeper(store, FAST, on_lost=Lost(), lease_id=lease)
    assert keeper.start() == lease
    wait_for(lambda: keeper.refreshes >= 1)
    keeper.stop(revoke=True)
    assert store.lease_info(lease) is None


def test_steps_down_before_the_ttl_when_etcd_is_unreachable(tmp_path: Path) -> None:
    server = EtcdServer(data_dir=tmp_path / "d", name="stepdown").start()
    store = EtcdStore(server.endpoint, keyspace=Keyspace("/stepdown"), timeout_s=1)
    lost = Lost()
    timing = LeaseTiming(ttl_s=4, keepalive_interval_s=0.5, retry_timeout_s=1.0)
    keeper = LeaseKeeper(store, timing, on_lost=lost)
    lease = keeper.start()
    wait_for(lambda: keeper.refreshes >= 1)
    try:
        server.kill()
        assert lost.event.wait(30)
        reason = lost.reasons[0]
        assert isinstance(reason, LeaseLostError) and "stepping down" in str(reason)
        # Declared lost only once the step-down age (ttl - keepalive interval) was reached.
        assert keeper.last_refresh_age_s >= timing.step_down_after_s
        keeper.stop(revoke=False)
        # etcd keeps leases across a restart: the holder that stepped down can still clean up.
        server.start()
        wait_for(lambda: _revoked(store, lease))
    finally:
        store.close()
        server.stop()


def _revoked(store: EtcdStore, lease: int) -> bool:
    try:
        store.revoke_lease(lease)
    except StoreUnavailableError:
        return False
    return store.lease_info(lease) is None
