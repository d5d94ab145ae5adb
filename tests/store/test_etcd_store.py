"""Store contract tests against a real etcd: reads, fenced writes, leases, errors."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable

import pytest

from gpupool_sdk.cli.common import resolve_endpoints
from gpupool_sdk.errors import ConfigError, GpupoolError, LeaseLostError, SchemaError, StoreUnavailableError
from gpupool_sdk.resources import JobSpec
from gpupool_sdk.store import Compare, Delete, EtcdStore, Keyspace, Put
from gpupool_sdk.store.launcher import free_port


def wait_for(cond: Callable[[], object], timeout: float = 30.0, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        time.sleep(interval)


def test_put_get_and_revisions(store: EtcdStore) -> None:
    key = store.keys.node("n1")
    rev = store.put(key, b"v1")
    kv = store.get(key)
    assert kv is not None and kv.value == b"v1" and kv.mod_revision == rev and kv.create_revision == rev
    rev2 = store.put(key, "v2")
    kv2 = store.get(key)
    assert kv2 is not None and kv2.value == b"v2" and kv2.mod_revision == rev2 > rev and kv2.version == 2
    assert store.get(store.keys.node("absent")) is None


def test_get_prefix_sorted_with_revision(store: EtcdStore) -> None:
    for n in ("c", "a", "b"):
        store.put(store.keys.node(n), n.encode())
    kvs, rev = store.get_prefix(store.keys.nodes_prefix())
    assert [kv.key.rsplit("/", 1)[-1] for kv in kvs] == ["a", "b", "c"]
    assert rev >= max(kv.mod_revision for kv in kvs)


def test_records_round_trip(store: EtcdStore) -> None:
    spec = JobSpec(name="bert", gpus=2, memory="1GiB")
    store.put(store.keys.job_spec("bert"), spec)
    got = store.get_record(store.keys.job_spec("bert"), JobSpec)
    assert got is not None and got[0] == spec


def test_malformed_value_written_by_etcdctl_is_reported_and_skipped(store: EtcdStore, etcdctl) -> None:  # type: ignore[no-untyped-def]
    good = JobSpec(name="good", memory="1GiB")
    store.put(store.keys.job_spec("good"), good)
    etcdctl("put", store.keys.job_spec("broken"), "{not json")
    etcdctl("put", store.keys.job_spec("wrongschema"), '{"schema": 99, "name": "x"}')
    errors: list[SchemaError] = []
    got = store.list_records(store.keys.jobs_prefix(), JobSpec, on_error=errors.append)
    assert [r.name for r, _ in got] == ["good"]
    assert sorted(e.key for e in errors) == sorted([store.keys.job_spec("broken"), store.keys.job_spec("wrongschema")])
    # Without on_error: logged, still skipped, never raised.
    assert [r.name for r, _ in store.list_records(store.keys.jobs_prefix(), JobSpec)] == ["good"]
    with pytest.raises(SchemaError, match="broken"):
        store.get_record(store.keys.job_spec("broken"), JobSpec)


def test_create_if_absent_loses_to_concurrent_create(etcd_endpoint: str, store: EtcdStore) -> None:
    key = store.keys.leader()
    contenders = [EtcdStore(etcd_endpoint, keyspace=store.keys) for _ in range(4)]
    barrier = threading.Barrier(len(contenders))
    results: dict[int, bool] = {}

    def contend(i: int) -> None:
        barrier.wait()
        results[i] = contenders[i].create(key, f"c{i}".encode())

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(contenders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in contenders:
        c.close()
    winners = [i for i, ok in results.items() if ok]
    assert len(winners) == 1
    kv = store.get(key)
    assert kv is not None and kv.value == f"c{winners[0]}".encode() and kv.version == 1


def test_replace_with_stale_revision_returns_false(store: EtcdStore) -> None:
    key = store.keys.job_status("j")
    store.put(key, b"a")
    kv = store.get(key)
    assert kv is not None
    assert store.replace(key, b"b", kv.mod_revision) is True
    assert store.replace(key, b"c", kv.mod_revision) is False  # stale: someone (we) wrote since
    latest = store.get(key)
    assert latest is not None and latest.value == b"b"


def test_txn_fenced_on_create_revision_fails_after_recreate(store: EtcdStore) -> None:
    leader, target = store.keys.leader(), store.keys.allocation("n1", "gpu-0", "j")
    store.put(leader, b"me")
    kv = store.get(leader)
    assert kv is not None
    fence = [Compare(leader, "create", "==", kv.create_revision), Compare(leader, "value", "==", b"me")]
    assert store.txn(fence, [Put(target, b"1")]) is True
    store.delete(leader)
    store.put(leader, b"me")  # same value, new incarnation: the fence must notice
    assert store.txn(fence, [Put(target, b"2")], failure=[Delete(target)]) is False
    assert store.get(target) is None  # the failure branch ran


def test_delete_prefix_and_refuses_root(store: EtcdStore) -> None:
    for g in ("g0", "g1"):
        store.put(store.keys.gpu("n", g), b"x")
    assert store.delete_prefix(store.keys.gpus_prefix()) == 2
    assert store.delete(store.keys.gpu("n", "g0")) is False
    with pytest.raises(ConfigError, match="prefix"):
        store.delete_prefix("/")


def test_lease_expiry_deletes_attached_keys(store: EtcdStore) -> None:
    lease = store.grant_lease(2)
    keys = [store.keys.job_spec("j"), store.keys.allocation("n", "g", "j")]
    for k in keys:
        store.put(k, b"x", lease=lease)
    info = store.lease_info(lease)
    assert info is not None and info.keys == sorted(keys) and info.granted_ttl == 2
    wait_for(lambda: store.lease_info(lease) is None)
    assert all(store.get(k) is None for k in keys)
    with pytest.raises(LeaseLostError):
        store.refresh_lease(lease)
    assert store.revoke_lease(lease) is False


def test_revoke_deletes_keys_at_once(store: EtcdStore) -> None:
    lease = store.grant_lease(30)
    key = store.keys.telemetry("j")
    store.put(key, b"x", lease=lease)
    assert store.refresh_lease(lease) == 30
    assert store.revoke_lease(lease) is True
    assert store.get(key) is None and store.lease_info(lease) is None


def test_unreachable_etcd_names_the_endpoint() -> None:
    dead = f"127.0.0.1:{free_port()}"
    s = EtcdStore(dead, keyspace=Keyspace("/x"), timeout_s=0.5)
    with pytest.raises(StoreUnavailableError, match=dead):
        s.get("/x/k")
    with pytest.raises(StoreUnavailableError, match=dead):
        s.put("/x/k", b"v")
    s.close()


def test_fails_over_to_a_live_endpoint(etcd_endpoint: str, keyspace: Keyspace) -> None:
    dead = f"127.0.0.1:{free_port()}"
    s = EtcdStore(f"{dead},{etcd_endpoint}", keyspace=keyspace, timeout_s=2)
    try:
        s.put(keyspace.node("n"), b"v")  # refused on the dead one, applied on the live one
        kv = s.get(keyspace.node("n"))
        assert kv is not None and kv.value == b"v" and s.endpoint == etcd_endpoint
    finally:
        s.delete_prefix(keyspace.root())
        s.close()


@pytest.mark.parametrize(
    ("endpoints", "field"),
    [("localhost", "endpoints"), ("h:99999", "endpoints"), ("", "endpoints"), ("ftp://h:1", "endpoints")],
)
def test_bad_endpoints_name_the_field(endpoints: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        EtcdStore(endpoints)
    assert info.value.field == field


def test_an_endpoint_with_a_port_out_of_range_says_so() -> None:
    """``127.0.0.1:99999`` is host:port in form: the message said "is not host:port" and left the user guessing."""
    with pytest.raises(ConfigError) as info:
        EtcdStore("127.0.0.1:99999")
    assert info.value.field == "endpoints" and "port 99999 is out of range (1-65535)" in str(info.value)


def test_endpoints_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUPOOL_ENDPOINTS", "http://a:1, b:2,a:1")
    monkeypatch.setenv("ETCDCTL_ENDPOINTS", "c:3")
    assert EtcdStore().endpoints == ("a:1", "b:2")
    # etcdctl's variable is the fallback, as for the TLS settings; then the loopback default.
    monkeypatch.delenv("GPUPOOL_ENDPOINTS")
    assert EtcdStore().endpoints == ("c:3",)
    assert resolve_endpoints(None) == "c:3" and resolve_endpoints("d:4") == "d:4"
    monkeypatch.delenv("ETCDCTL_ENDPOINTS")
    assert EtcdStore().endpoints == ("127.0.0.1:2379",)


def test_compare_validates_arguments() -> None:
    with pytest.raises(ConfigError, match="target"):
        Compare("/k", "size", "==", 1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="op"):
        Compare("/k", "mod", ">=", 1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="value"):
        Compare("/k", "mod", "==", "1")


def _use_in_child(store: EtcdStore, q: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    try:
        store.get("/x")
        q.put("no error")
    except GpupoolError as exc:
        q.put(str(exc))


def test_use_in_forked_child_is_a_clear_error(store: EtcdStore) -> None:
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_use_in_child, args=(store, q))
    p.start()
    msg = q.get(timeout=30)
    p.join(30)
    assert "create a new EtcdStore in the child" in msg


def test_cluster_status(store: EtcdStore) -> None:
    st = store.cluster_status()
    assert st["is_leader"] and st["revision"] >= 1 and st["version"].startswith("3.")


def test_closed_store_refuses(etcd_endpoint: str) -> None:
    s = EtcdStore(etcd_endpoint)
    s.close()
    with pytest.raises(GpupoolError, match="closed"):
        s.get("/x")


def test_get_prefix_skips_prefixes_at_one_revision(store: EtcdStore) -> None:
    keys = store.keys
    wanted = [keys.gpu("n", "GPU-1"), keys.node("n"), keys.result("j"), keys.usage("j")]
    for k in wanted + [keys.readings("n", "GPU-1"), keys.readings("m", "GPU-2")]:
        store.put(k, b"{}")
    last = store.put(keys.term(), b"1")
    kvs, rev = store.get_prefix(keys.root(), skip=(keys.readings_prefix(),))
    assert [kv.key for kv in kvs] == sorted(wanted + [keys.term()]) and rev == last
    everything, _ = store.get_prefix(keys.root())
    assert len(everything) == len(kvs) + 2
    # A skip outside the prefix, or two that overlap, change nothing else.
    again, _ = store.get_prefix(keys.root(), skip=("/elsewhere/", keys.readings_prefix(), keys.readings_prefix("n")))
    assert again == kvs
    only, _ = store.get_prefix(keys.readings_prefix(), skip=(keys.readings_prefix("n"),))
    assert [kv.key for kv in only] == [keys.readings("m", "GPU-2")]
