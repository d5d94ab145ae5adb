"""The store layer: the only code that talks to etcd.

* :mod:`~gpupool_sdk.store.keyspace`: every key, built in one place.
* :mod:`~gpupool_sdk.store.codec`: JSON values with a schema version.
* :mod:`~gpupool_sdk.store.launcher`: an embedded etcd on loopback.
"""

from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.launcher import EtcdServer, find_etcd_binary, find_etcdctl_binary

__all__ = ["EtcdServer", "Keyspace", "find_etcd_binary", "find_etcdctl_binary"]
