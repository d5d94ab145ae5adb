"""The node agent: publishes one node's GPUs under its own etcd lease and keeps them current.

Keys (see :mod:`gpupool_sdk.store.keyspace`), all attached to the agent's lease:

- ``nodes/{node}``: a :class:`~gpupool_sdk.resources.NodeInfo`.
- ``gpus/{node}/{uuid}``: a :class:`~gpupool_sdk.resources.GpuInfo` per GPU, health included.
- ``readings/{node}/{uuid}``: a :class:`~gpupool_sdk.resources.GpuReadings` per GPU whose usage
  readings are known (NVML; none for simulated GPUs and MIG instances).

Life cycle:

1. :meth:`NodeAgent.start` grants a lease (a :class:`~gpupool_sdk.store.LeaseKeeper` keeps it
   alive from its own thread) and publishes the node and every GPU in one transaction, taking
   over keys a previous incarnation left behind and deleting GPUs the node no longer has.
2. :meth:`NodeAgent.tick`, called by a loop every ``refresh_interval_s``, reads fresh health
   from the backend and reconciles: it lists ``gpus/{node}/`` and rewrites only the GPUs whose
   published value differs (changed health, a hand-edited or malformed value, a key deleted by
   hand or attached to another lease); stray keys under the node's prefix are deleted.
   Temperatures are published in whole degrees and power in steps of 5 W, so noise in the
   readings does not rewrite keys on every refresh. The usage readings (utilisation, memory
   bandwidth, memory used, PCIe and NVLink bytes/s) move on every refresh, so they are not in the
   GPU record (the scheduler's input: every write of it wakes the coordinator) but under
   ``readings/{node}/{uuid}``, which the coordinator neither reads nor watches. They are read on
   every refresh and reconciled (the ones that changed written, stray keys deleted) at most once per
   ``usage_interval_s`` (10 s by default; 0: on every refresh; None: never published). The agent's
   metrics exporter sees every refresh's readings.
3. If the lease is lost (etcd expired it after a partition, or someone revoked it), the agent
   re-registers at once: a new lease and a full publish.
4. :meth:`NodeAgent.stop` revokes the lease, so every key of the node vanishes at once. A
   killed agent's keys vanish when the lease expires, one TTL later.

Nothing the agent reads can crash it: a malformed value is reported with a warning and
overwritten; an unreachable etcd is retried; a failing backend is reported and retried.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.errors import (
    ConfigError,
    GpupoolError,
    LeaseLostError,
    NodeClaimedError,
    SchemaError,
    StoreError,
)
from gpupool_sdk.inventory.base import InventoryBackend
from gpupool_sdk.resources.gpu import GpuInfo, GpuReadings, NodeInfo
from gpupool_sdk.store.codec import decode
from gpupool_sdk.store.etcd_store import EtcdStore, iter_chunks
from gpupool_sdk.store.lease import LeaseKeeper
from gpupool_sdk.store.types import Delete, KeyValue, Put

log = logging.getLogger(__name__)

#: Published temperatures are rounded to this many degrees C, power to this many watts.
TEMPERATURE_STEP_C = 1.0
POWER_STEP_W = 5.0
#: The usage readings are published at most this often (seconds).
DEFAULT_USAGE_INTERVAL_S = 10.0
#: After a failed etcd call, retry this soon (seconds) rather than after a full interval.
RETRY_AFTER_S = 1.0
_TXN_OPS = 128  # etcd's default cap on operations per transaction


def _round_to(value: float | None, step: float) -> float | None:
    return None if value is None else float(round(value / step) * step)


def publishable(gpu: GpuInfo) -> GpuInfo:
    """``gpu`` as the agent publishes it: readings rounded so that noise does not cause rewrites."""
    h = gpu.health
    return replace(
        gpu,
        health=replace(
            h,
            temperature_c=_round_to(h.temperature_c, TEMPERATURE_STEP_C),
            power_w=_round_to(h.power_w, POWER_STEP_W),
        ),
    )


class NodeAgent:
    """Publishes one node (a backend) under its own etcd lease.

    Args:
        store: the etcd store (shared by several agents of one process is fine).
        backend: the inventory of the node (simulated or NVML).
        timing: TTL, keepalive interval and retry deadline of the agent's lease.
        refresh_interval_s: seconds between health refreshes.
        wake: event set when the agent needs attention before its next refresh (lease lost);
            a process running several agents passes one shared event to all of them.
        usage_interval_s: the usage readings (``readings/{node}/{uuid}``) are published, those
            that changed, when the last publication is at least this old (seconds); 0: on every
            refresh; None: never (no readings keys).
        clock: monotonic clock for ``usage_interval_s`` (tests pass their own).

    Raises:
        ConfigError: ``refresh_interval_s`` is not a positive number, or ``usage_interval_s`` is
            not None or a number of seconds >= 0.

    Example:
        >>> from gpupool_sdk.inventory import simulated_backends          # doctest: +SKIP
        >>> agent = NodeAgent(store, simulated_backends("n:4xT4")[0], LeaseTiming())   # doctest: +SKIP
        >>> agent.start()   # doctest: +SKIP
        >>> agent.tick()   # call every refresh_interval_s   # doctest: +SKIP
        >>> agent.stop()   # revokes the lease: the node's keys vanish at once   # doctest: +SKIP
    """

    def __init__(
        self,
        store: EtcdStore,
        backend: InventoryBackend,
        timing: LeaseTiming,
        refresh_interval_s: float = 5.0,
        wake: threading.Event | None = None,
        take_over: bool = False,
        usage_interval_s: float | None = DEFAULT_USAGE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        r = refresh_interval_s
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
            raise ConfigError("refresh_interval_s", f"must be a positive number of seconds, got {r!r}")
        u = usage_interval_s
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not math.isfinite(u) or u < 0):
            raise ConfigError(
                "usage_interval_s", f"must be None (never published) or a number of seconds >= 0, got {u!r}"
            )
        self.usage_interval_s = None if u is None else float(u)
        self._clock = clock
        self._readings_at: float | None = None  # clock() when the readings were last published
        self.store = store
        self.backend = backend
        self.timing = timing
        self.refresh_interval_s = float(r)
        self.node = backend.node
        self.wake = wake if wake is not None else threading.Event()
        self.take_over = take_over
        self._keeper: LeaseKeeper | None = None
        self._lease_lost = threading.Event()
        self._next_at = 0.0
        self._registered = False
        self._generation = 0
        self._health: dict[str, bool] = {}
        self._models: dict[str, str] = {}
        self._warned: set[str] = set()
        self.registrations = 0
        self.refreshes = 0
        self.writes = 0
        # What the last refresh read (unrounded), for the agent's metrics exporter.
        self.last_node_info: NodeInfo | None = None
        self.last_gpus: tuple[GpuInfo, ...] = ()
        self.last_readings: Mapping[str, GpuReadings] = {}

    # ---------------------------------------------------------------------------- public

    @property
    def lease_id(self) -> int | None:
        """The current lease, or None when not registered."""
        return self._keeper.lease_id if self._keeper is not None and self._registered else None

    @property
    def registered(self) -> bool:
        """True while the node is published under a live lease (as far as the agent knows)."""
        return self._registered and not self._lease_lost.is_set()

    def start(self) -> int:
        """Grant a lease and publish the node and its GPUs.

        Returns:
            The lease id.

        Raises:
            NodeClaimedError: another live agent publishes this node name (and ``take_over`` is off).
            StoreUnavailableError: etcd cannot be reached.
            StoreError: another etcd failure.
        """
        self._register()
        assert self._keeper is not None
        return self._keeper.lease_id

    def tick(self) -> float:
        """Do what is due: re-register after a lost lease, refresh health when the interval is up.

        Never raises for etcd or backend failures (they are logged and retried soon).

        Returns:
            Seconds until the agent next needs a :meth:`tick`.

        Raises:
            NodeClaimedError: another live agent took this node name over; this agent must stop
                publishing it (two agents writing one node would overwrite each other forever).
        """
        now = time.monotonic()
        try:
            if not self._registered or self._lease_lost.is_set():
                if self._lease_lost.is_set():
                    log.warning("node %s: lease lost; registering again", self.node)
                self._register()
                return self.refresh_interval_s
            if now >= self._next_at:
                self.refresh()
            return max(0.0, self._next_at - time.monotonic())
        except NodeClaimedError:
            raise
        except LeaseLostError as exc:
            log.warning("node %s: lease lost (%s); registering again", self.node, exc)
            self._lease_lost.set()
            return 0.0
        except StoreError as exc:
            log.warning("node %s: etcd call failed (%s); retrying in %gs", self.node, exc, RETRY_AFTER_S)
            self._next_at = time.monotonic() + RETRY_AFTER_S
            return RETRY_AFTER_S
        except Exception as exc:  # a backend or bug must not take the agent (and the node's GPUs) down
            log.exception("node %s: refresh failed (%s); retrying in %gs", self.node, exc, self.refresh_interval_s)
            self._next_at = time.monotonic() + self.refresh_interval_s
            return self.refresh_interval_s

    def refresh(self) -> int:
        """Read health now and rewrite the GPUs whose published value differs.

        Returns:
            The number of keys written or deleted.

        Raises:
            LeaseLostError: the lease is gone (the caller re-registers).
            StoreError: etcd failed.
        """
        lease = self._lease()
        n = self._sync(lease, full=False)
        self.refreshes += 1
        self._next_at = time.monotonic() + self.refresh_interval_s
        return n

    def stop(self, revoke: bool = True) -> None:
        """Stop keeping the lease alive; with ``revoke`` the node's keys vanish at once.

        Never raises: with etcd unreachable the keys vanish when the lease expires.
        """
        keeper, self._keeper = self._keeper, None
        self._registered = False
        if keeper is not None:
            keeper.stop(revoke=revoke)
            if revoke:
                log.info("node %s: lease %x revoked; its keys are gone", self.node, keeper.lease_id)

    # ---------------------------------------------------------------------------- internals

    def _on_lost(self, generation: int, reason: GpupoolError) -> None:
        # Called from a keeper thread: only flag it; the agent's loop re-registers. A keeper of an
        # earlier registration may report its (already replaced) lease late: ignore it.
        if generation != self._generation:
            return
        self._lease_lost.set()
        self.wake.set()

    def _lease(self) -> int:
        if self._keeper is None or not self._registered:
            raise LeaseLostError(f"node {self.node} is not registered")
        if self._lease_lost.is_set():
            raise LeaseLostError(f"lease {self._keeper.lease_id:x} of node {self.node} was lost")
        return self._keeper.lease_id

    def _register(self) -> None:
        old, self._keeper = self._keeper, None
        self._registered = False
        if old is not None:
            # The old lease is lost or about to expire; the full publish below moves every key of the
            # node onto the new lease, so nothing is left on the old one.
            old.stop(revoke=False)
        self._lease_lost.clear()
        self._generation += 1
        generation = self._generation
        keeper = LeaseKeeper(self.store, self.timing, on_lost=lambda reason: self._on_lost(generation, reason))
        lease = keeper.start()
        self._keeper = keeper
        self._registered = True
        try:
            self._sync(lease, full=True)
        except BaseException:
            # Publishing failed: give the lease back rather than leave a half-published node.
            self._keeper = None
            self._registered = False
            keeper.stop(revoke=True)
            raise
        self.registrations += 1
        self._next_at = time.monotonic() + self.refresh_interval_s
        log.info(
            "node %s: published %d GPU(s) %s under lease %x (ttl %gs)",
            self.node,
            len(self._models),
            ", ".join(sorted(set(self._models.values()))),
            lease,
            self.timing.ttl_s,
        )

    def _sync(self, lease: int, full: bool) -> int:
        keys = self.store.keys
        node_info = self.backend.node_info()
        raw = self.backend.gpus()
        gpus = {g.uuid: publishable(g) for g in raw}
        self.last_node_info, self.last_gpus = node_info, tuple(raw)
        self.last_readings = {u: r for u, r in self.backend.readings().items() if u in gpus and r.known}
        self._models = {u: g.model for u, g in gpus.items()}
        node_info = replace(node_info, gpu_count=len(gpus))
        self._log_health_changes(gpus.values())

        ops: list[Put | Delete] = []
        node_key = keys.node(self.node)
        node_kv = self.store.get(node_key)
        if node_kv is not None and node_kv.lease not in (0, lease):
            self._check_claim(node_kv, first=full and self.registrations == 0)
        if full or self._differs(node_kv, NodeInfo, node_info, lease):
            ops.append(Put(node_key, node_info, lease))

        ops.extend(self._reconcile("gpus", GpuInfo, gpus, lease, full))

        now = self._clock()
        u = self.usage_interval_s
        due = u is not None and (full or self._readings_at is None or now - self._readings_at >= u)
        if due:
            ops.extend(self._reconcile("readings", GpuReadings, self.last_readings, lease, full))

        for chunk in iter_chunks(ops, _TXN_OPS):
            self._apply(chunk, lease)
        self.writes += len(ops)
        if due:
            self._readings_at = now  # only once written: after a failed write the retry publishes them
        return len(ops)

    def _reconcile(self, kind: str, cls: Any, want: Mapping[str, Any], lease: int, full: bool) -> list[Put | Delete]:
        """Puts of the ``kind`` keys of this node (``gpus``, ``readings``) whose published value
        differs from ``want`` (by GPU UUID), deletes of the keys of GPUs not in it."""
        keys = self.store.keys
        ops: list[Put | Delete] = []
        listed, _ = self.store.get_prefix(keys.gpus_prefix(self.node) if kind == "gpus" else keys.readings_prefix(self.node))
        seen: set[str] = set()
        for kv in listed:
            parsed = keys.parse(kv.key)
            if parsed is None or parsed.kind != kind or parsed.parts[0] != self.node:
                self._warn_once(kv.key, f"node {self.node}: ignoring key {kv.key!r} of unknown shape under the node's prefix")
                continue
            uuid = parsed.parts[1]
            if uuid not in want:
                if kind == "gpus":  # (readings come and go with what NVML can read: no warning)
                    log.warning("node %s: deleting %s: not a GPU of this node (stale or written by hand)", self.node, kv.key)
                ops.append(Delete(kv.key))
                continue
            seen.add(uuid)
            if full or self._differs(kv, cls, want[uuid], lease):
                ops.append(Put(kv.key, want[uuid], lease))
        for uuid, value in want.items():
            if uuid not in seen:
                if not full and kind == "gpus":
                    log.warning("node %s: %s was missing from etcd; publishing it again", self.node, uuid)
                key = keys.gpu(self.node, uuid) if kind == "gpus" else keys.readings(self.node, uuid)
                ops.append(Put(key, value, lease))
        return ops

    def _apply(self, ops: Sequence[Put | Delete], lease: int) -> None:
        try:
            self.store.txn([], ops)
        except LeaseLostError:
            raise
        except StoreError as exc:
            # etcd reports a put on a revoked or expired lease as "requested lease not found".
            if "lease not found" in str(exc).lower():
                raise LeaseLostError(f"lease {lease:x} of node {self.node} is gone: {exc}") from None
            raise

    def _differs(self, kv: KeyValue | None, cls: Any, want: Any, lease: int) -> bool:
        have = self._published(kv, cls, lease)
        return have is None or bool(have != want)

    def _published(self, kv: KeyValue | None, cls: Any, lease: int) -> Any:
        """The record in ``kv``; None when it must be rewritten (missing, malformed, on another lease)."""
        if kv is None:
            return None
        try:
            have = decode(kv.key, kv.value, cls)
        except SchemaError as exc:
            log.warning("node %s: malformed value (%s); rewriting it", self.node, exc)
            return None
        if kv.lease != lease:
            log.warning("node %s: %s is not attached to lease %x (written by hand?); rewriting it", self.node, kv.key, lease)
            return None
        return have

    def _check_claim(self, kv: KeyValue, first: bool) -> None:
        """The node key is on another lease: take it over, or raise when another agent owns it.

        Taken over quietly: a dead lease (a killed agent, a partition), or a live one whose agent is
        this process (an earlier registration whose lease it gave up for lost while etcd still kept
        it) or ran on this host and is gone (a previous incarnation restarted within its TTL).
        Otherwise another agent publishes this node name: on this agent's first registration it
        refuses to start unless ``take_over``; later (the other agent took over, e.g. started with
        ``--take-over``) it stops, rather than rewrite the node every refresh.
        """
        prev = self._previous(kv)
        who = "an unreadable value" if prev is None else f"the agent with pid {prev.agent_pid} on {prev.hostname or '?'}"
        info = self.store.lease_info(kv.lease)
        if info is None or info.ttl_remaining <= 0:
            log.warning("node %s was published by %s under lease %x, now expired; taking it over", self.node, who, kv.lease)
            return
        if prev is not None and _mine_or_gone(prev):
            log.warning(
                "node %s was published by %s (this process before, or gone from this host) under lease %x; "
                "taking it over",
                self.node,
                who,
                kv.lease,
            )
            return
        if first and self.take_over:
            log.warning(
                "node %s is published by %s under live lease %x; taking it over (--take-over): that agent stops "
                "at its next refresh",
                self.node,
                who,
                kv.lease,
            )
            return
        if first:
            raise NodeClaimedError(
                f"node {self.node} is already published by {who} under live lease {kv.lease:x}: two agents "
                "cannot publish one node name. Give this agent another --node, stop the other agent (its keys "
                f"vanish within its lease TTL), or pass --take-over to replace it"
            )
        raise NodeClaimedError(
            f"node {self.node} was taken over by {who} under lease {kv.lease:x}; this agent stops publishing it "
            "(two agents cannot publish one node name)"
        )

    @staticmethod
    def _previous(kv: KeyValue) -> NodeInfo | None:
        try:
            return decode(kv.key, kv.value, NodeInfo)
        except SchemaError:
            return None

    def _log_health_changes(self, gpus: Any) -> None:
        for g in gpus:
            before = self._health.get(g.uuid)
            if before is not None and before != g.healthy:
                if g.healthy:
                    log.info("node %s: GPU %s (index %d) is healthy again", self.node, g.uuid, g.index)
                else:
                    log.warning(
                        "node %s: GPU %s (index %d) is unhealthy: %s", self.node, g.uuid, g.index, "; ".join(g.health.reasons)
                    )
            elif before is None and not g.healthy:
                log.warning("node %s: GPU %s (index %d) is unhealthy: %s", self.node, g.uuid, g.index, "; ".join(g.health.reasons))
            self._health[g.uuid] = g.healthy

    def _warn_once(self, tag: str, message: str) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            log.warning("%s", message)


def _mine_or_gone(prev: NodeInfo) -> bool:
    """True when ``prev`` names this process (an earlier registration) or a process of this host that is gone."""
    if prev.hostname != socket.gethostname() or prev.agent_pid <= 0:
        return False
    if prev.agent_pid == os.getpid():
        return True
    try:
        os.kill(prev.agent_pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists but belongs to someone else
        return False
    return False


def run_agents(
    agents: Sequence[NodeAgent],
    stop: threading.Event,
    wake: threading.Event | None = None,
    on_started: Callable[[Sequence[NodeAgent]], None] | None = None,
) -> None:
    """Start every agent, tick them until ``stop`` is set, then stop them (revoking their leases).

    Args:
        agents: the agents (one per node) of this process.
        stop: set it (e.g. from a signal handler) to shut down.
        wake: the event the agents were given; setting it makes the loop look at once.
        on_started: called once every agent has registered.

    Raises:
        StoreError: the first registration of an agent failed (the ones already started are
            stopped and their leases revoked first).
    """
    wake = wake if wake is not None else threading.Event()
    started: list[NodeAgent] = []
    try:
        for a in agents:
            a.start()
            started.append(a)
        if on_started is not None:
            on_started(agents)
        while not stop.is_set():
            delay = 1.0
            for i, a in enumerate(agents):
                if stop.is_set():
                    break
                d = a.tick()
                delay = d if i == 0 else min(delay, d)
            if stop.is_set():
                break
            wake.wait(max(0.01, delay))
            wake.clear()
    finally:
        stop_all(started)


def stop_all(agents: Sequence[NodeAgent], revoke: bool = True) -> None:
    """Stop agents in parallel (with etcd unreachable each stop may wait out a timeout)."""
    if len(agents) <= 1:
        for a in agents:
            a.stop(revoke=revoke)
        return
    with ThreadPoolExecutor(max_workers=min(16, len(agents)), thread_name_prefix="gpupool-agent-stop") as pool:
        list(pool.map(lambda a: a.stop(revoke=revoke), agents))
