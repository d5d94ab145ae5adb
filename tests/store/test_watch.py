"""Watches against a real etcd: order, resume after reconnect, resync after compaction."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit import wait_for

from gpupool_sdk.store import EtcdServer, EtcdStore, Keyspace, WatchEvent


class Collector:
    def __init__(self) -> None:
        self.events: list[WatchEvent] = []
        self.lock = threading.Lock()

    def __call__(self, events: list[WatchEvent]) -> None:
        with self.lock:
            self.events.extend(events)

    def values(self) -> list[bytes]:
        with self.lock:
            return [e.kv.value for e in self.events if e.type == "put"]


@pytest.fixture(scope="module")
def restartable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """An etcd of its own (fixed data dir and ports) that tests may kill and restart."""
    server = EtcdServer(data_dir=Path(tmp_path_factory.mktemp("etcd-restart")) / "data", name="restartable")
    server.start(timeout=60)
    yield server
    server.stop()


def test_events_in_order_with_prev(store: EtcdStore) -> None:
    got = Collector()
    w = store.watch_prefix(store.keys.jobs_prefix(), got)
    assert w.wait_ready(10)
    key = store.keys.job_spec("a")
    store.put(key, b"1")
    store.put(key, b"2")
    store.delete(key)
    wait_for(lambda: len(got.events) == 3)
    assert [e.type for e in got.events] == ["put", "put", "delete"]
    assert got.events[1].prev is not None and got.events[1].prev.value == b"1"
    assert got.events[2].prev is not None and got.events[2].prev.value == b"2"
    w.cancel()
    store.put(key, b"3")
    time.sleep(0.2)  # give a (wrongly) live watch the chance to deliver; the assertion is on state
    assert len(got.events) == 3


def test_start_revision_replays_history(store: EtcdStore) -> None:
    key = store.keys.node("n")
    first = store.put(key, b"1")
    store.put(key, b"2")
    got = Collector()
    w = store.watch_prefix(store.keys.nodes_prefix(), got, start_revision=first)
    wait_for(lambda: len(got.events) == 2)
    assert got.values() == [b"1", b"2"]
    w.cancel()


def test_watch_resumes_after_etcd_restart_without_loss_or_repeat(restartable: EtcdServer) -> None:
    ks = Keyspace("/resume-test")
    watching = EtcdStore(restartable.endpoint, keyspace=ks, timeout_s=2)
    writer = EtcdStore(restartable.endpoint, keyspace=ks, timeout_s=2)
    got = Collector()
    w = watching.watch_prefix(ks.nodes_prefix(), got)
    assert w.wait_ready(10)
    for i in range(5):
        writer.put(ks.node(f"n{i}"), f"{i}".encode())
    wait_for(lambda: len(got.events) == 5)
    reconnects = w.reconnects
    restartable.kill()  # crash, not a clean stop
    restartable.start(timeout=60)
    # Write at once, before the watch has had time to come back: a watch that resumed from
    # "now" instead of its last revision + 1 would miss these.
    for i in range(5, 10):
        writer.put(ks.node(f"n{i}"), f"{i}".encode())
    wait_for(lambda: len(got.events) >= 10)
    time.sleep(0.2)
    assert got.values() == [f"{i}".encode() for i in range(10)]
    revs = [e.kv.mod_revision for e in got.events]
    assert revs == sorted(set(revs))
    assert w.reconnects > reconnects
    w.cancel()
    watching.close()
    writer.close()


def test_compacted_start_revision_triggers_resync(store: EtcdStore) -> None:
    key = store.keys.node("c")
    old = store.put(key, b"old")
    store.put(key, b"newer")
    now = store.put(key, b"newest")
    store.compact(now)
    resyncs: list[int] = []

    def relist() -> None:
        kv = store.get(key)
        assert kv is not None
        resyncs.append(kv.mod_revision)

    got = Collector()
    w = store.watch_prefix(store.keys.nodes_prefix(), got, start_revision=old, on_resync=relist)
    wait_for(lambda: resyncs)
    assert w.wait_ready(10)
    store.put(key, b"after")
    wait_for(lambda: got.values() == [b"after"])
    assert w.resyncs == 1
    w.cancel()


def test_resync_resumes_after_the_revision_the_consumer_returns(store: EtcdStore) -> None:
    key = store.keys.node("r")
    old = store.put(key, b"1")
    now = store.put(key, b"2")
    store.compact(now)
    got = Collector()
    w = store.watch_prefix(store.keys.nodes_prefix(), got, start_revision=old, on_resync=lambda: now)
    assert w.wait_ready(10)
    store.put(key, b"3")
    wait_for(lambda: got.values() == [b"3"])
    assert w.next_revision is not None and w.next_revision > now
    w.cancel()


def test_callback_errors_do_not_kill_the_watch(store: EtcdStore) -> None:
    seen: list[bytes] = []

    def flaky(events: list[WatchEvent]) -> None:
        seen.extend(e.kv.value for e in events)
        if len(seen) == 1:
            raise RuntimeError("consumer bug")

    w = store.watch_prefix(store.keys.acks_prefix(), flaky)
    assert w.wait_ready(10)
    store.put(store.keys.ack("a"), b"1")
    wait_for(lambda: seen == [b"1"])
    store.put(store.keys.ack("a"), b"2")
    wait_for(lambda: seen == [b"1", b"2"])
    w.cancel()
    assert not w.running


def test_skipped_prefixes_are_never_delivered(store: EtcdStore) -> None:
    got = Collector()
    w = store.watch_prefix(store.keys.root(), got, skip=(store.keys.readings_prefix(),))
    assert w.wait_ready(10)
    noise = [store.put(store.keys.readings("n", f"GPU-{i}"), b"{}") for i in range(3)]
    store.delete(store.keys.readings("n", "GPU-0"))
    wait_for(lambda: w.next_revision is not None and w.next_revision > noise[-1] + 1, what="the skipped events to pass")
    assert got.events == []  # the callback never ran for a batch of skipped events
    rev = store.put(store.keys.node("n"), b"1")
    store.put(store.keys.readings("n", "GPU-1"), b"{}")
    wait_for(lambda: w.next_revision is not None and w.next_revision > rev + 1, what="the events to pass")
    assert [e.kv.key for e in got.events] == [store.keys.node("n")]
    w.cancel()
