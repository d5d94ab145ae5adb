"""The store layer: the only code that talks to etcd.

* :mod:`~gpupool_sdk.store.keyspace`: every key, built in one place.
* :mod:`~gpupool_sdk.store.codec`: JSON values with a schema version.
* :mod:`~gpupool_sdk.store.etcd_store`: :class:`EtcdStore`, reads, fenced writes, leases.
* :mod:`~gpupool_sdk.store.lease`: :class:`LeaseKeeper`, keepalive with a timely step-down.
* :mod:`~gpupool_sdk.store.watch`: :class:`Watcher`, prefix watches that survive reconnects and compaction.
* :mod:`~gpupool_sdk.store.security`: :class:`EtcdSecurity`, TLS and etcd-auth settings (no gRPC).
* :mod:`~gpupool_sdk.store.launcher`: an embedded etcd on loopback (plaintext or TLS).

The names that need gRPC (``EtcdStore``, ``LeaseKeeper``, ``Watcher``, ``decode_all``) are imported
on first access, so that a training process importing keys, records or the launcher never loads
gRPC (its client talks to etcd from a spawned helper process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpupool_sdk.store.endpoints import parse_endpoints
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.launcher import (
    EtcdCluster,
    EtcdServer,
    EtcdServerTLS,
    find_etcd_binary,
    find_etcdctl_binary,
)
from gpupool_sdk.store.records import ResumeRecord, TelemetryRecord
from gpupool_sdk.store.security import EtcdSecurity
from gpupool_sdk.store.types import Compare, Delete, KeyValue, LeaseInfo, Put, WatchEvent

if TYPE_CHECKING:
    from gpupool_sdk.store.etcd_store import EtcdStore, decode_all
    from gpupool_sdk.store.lease import LeaseKeeper
    from gpupool_sdk.store.watch import Watcher

_LAZY = {
    "EtcdStore": "gpupool_sdk.store.etcd_store",
    "decode_all": "gpupool_sdk.store.etcd_store",
    "LeaseKeeper": "gpupool_sdk.store.lease",
    "Watcher": "gpupool_sdk.store.watch",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpupool_sdk.store' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Compare",
    "Delete",
    "EtcdSecurity",
    "EtcdCluster",
    "EtcdServer",
    "EtcdServerTLS",
    "EtcdStore",
    "KeyValue",
    "Keyspace",
    "LeaseInfo",
    "LeaseKeeper",
    "Put",
    "ResumeRecord",
    "TelemetryRecord",
    "WatchEvent",
    "Watcher",
    "decode_all",
    "find_etcd_binary",
    "find_etcdctl_binary",
    "parse_endpoints",
]
