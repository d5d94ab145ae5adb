"""Range compares (``Compare(..., prefix=True)``) against a real etcd: what the grant's GPU guard relies on."""

from __future__ import annotations

from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.types import Compare, Put


def _unchanged_since(store: EtcdStore, prefix: str, revision: int) -> bool:
    """True when no key under ``prefix`` was created or rewritten after ``revision`` (an empty txn)."""
    return store.txn([Compare(prefix, "mod", "<", revision + 1, prefix=True)], [])


def test_a_range_compare_fails_on_any_key_written_under_the_prefix_after_the_revision(store: EtcdStore) -> None:
    ks = store.keys
    gpu = ks.allocations_prefix("node-a", "GPU-1")
    store.put(gpu + "a", b"1")
    rev = store.put(gpu + "b", b"2")
    assert _unchanged_since(store, gpu, rev)
    assert not _unchanged_since(store, gpu, rev - 1)  # b came after rev - 1
    store.put(gpu + "ghost", b"3")
    assert not _unchanged_since(store, gpu, rev)
    store.put(gpu + "a", b"1 again")  # a rewrite counts too
    store.delete(gpu + "ghost")
    assert not _unchanged_since(store, gpu, rev)
    assert store.delete(gpu + "a")
    # Only b is left, older than rev: a deleted key is simply not there (deleting frees room,
    # it never overcommits a GPU, so a guard on a GPU must not fail on it).
    assert _unchanged_since(store, gpu, rev)


def test_an_empty_range_holds_and_a_sibling_gpu_is_not_in_the_range(store: EtcdStore) -> None:
    ks = store.keys
    gpu1, gpu10 = ks.allocations_prefix("node-a", "GPU-1"), ks.allocations_prefix("node-a", "GPU-10")
    assert gpu1.endswith("/GPU-1/") and gpu10.startswith(gpu1[:-1])
    rev = store.revision()
    assert _unchanged_since(store, gpu1, rev)  # nothing there at all
    store.put(gpu10 + "j", b"x")  # GPU-10 starts with "GPU-1" but is another GPU
    store.put(ks.allocations_prefix("node-a") + "GPU-1", b"x")  # nor is a key named like the GPU
    assert _unchanged_since(store, gpu1, rev)
    assert not _unchanged_since(store, gpu10, rev)


def test_a_transaction_reports_the_revision_of_its_writes(store: EtcdStore) -> None:
    key = store.keys.allocations_prefix("node-a", "GPU-0") + "j"
    ok, rev = store.txn_at([Compare(key, "create", "==", 0)], [Put(key, b"v")])
    kv = store.get(key)
    assert ok and kv is not None and kv.mod_revision == rev
    ok, _ = store.txn_at([Compare(key, "create", "==", 0)], [Put(key, b"w")])
    assert not ok
