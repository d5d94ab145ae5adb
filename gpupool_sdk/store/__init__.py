"""The store layer: the only code that talks to etcd.

* :mod:`~gpupool_sdk.store.keyspace`: every key, built in one place.
* :mod:`~gpupool_sdk.store.codec`: JSON values with a schema version.
* :mod:`~gpupool_sdk.store.etcd_store`: :class:`EtcdStore`, reads, fenced writes, leases.
* :mod:`~gpupool_sdk.store.lease`: :class:`LeaseKeeper`, keepalive with a timely step-down.
* :mod:`~gpupool_sdk.store.watch`: :class:`Watcher`, prefix watches that survive reconnects and compaction.
* :mod:`~gpupool_sdk.store.launcher`: an embedded etcd on loopback.
"""

from gpupool_sdk.store.etcd_store import EtcdStore, decode_all
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.launcher import EtcdServer, find_etcd_binary, find_etcdctl_binary
from gpupool_sdk.store.lease import LeaseKeeper
from gpupool_sdk.store.records import ResumeRecord, TelemetryRecord
from gpupool_sdk.store.types import Compare, Delete, KeyValue, LeaseInfo, Put, WatchEvent
from gpupool_sdk.store.watch import Watcher

__all__ = [
    "Compare",
    "Delete",
    "EtcdServer",
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
]
