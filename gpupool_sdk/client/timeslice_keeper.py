"""The etcd side of step-level time-slicing: one keeper process per gated job and GPU.

Started by :meth:`~gpupool_sdk.client.timeslice.TimeSliceGate.start` as a fresh interpreter
(``python -m gpupool_sdk.client.timeslice_keeper FD``), never by ``fork()``, for the same reason
as the client's I/O helper: the training process never runs gRPC.

The keeper holds an etcd lease of its own and on it writes
``timeslice/{node}/{gpu}/members/{job}`` (this job takes part). It watches the GPU's
allocations and ``timeslice/{node}/{gpu}/``, and on every change (and every second, for the
overrun rule) re-reads them and runs the pure rule :func:`~gpupool_sdk.client.timeslice.plan_turn`:
its result replaces the turn key by compare-and-swap on the mod revision (create-if-absent when
there is none). A holder's keeper moves the turn key onto its own lease, so a holder that dies
takes the turn with it and the others hand it on at once. The gate is told the state after each
change. When the pipe to the gate closes (the job closed the gate or died), the keeper revokes
its lease (membership and any turn it holds vanish) and exits.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from gpupool_sdk.client.timeslice import TimeSliceSettings, Turn, plan_turn, quantum_s
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.errors import GpupoolError, SchemaError, StoreError
from gpupool_sdk.resources import Allocation, GpuInfo
from gpupool_sdk.store.codec import decode
from gpupool_sdk.store.etcd_store import EtcdStore
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.lease import LeaseKeeper
from gpupool_sdk.store.types import Compare, KeyValue, Put

log = logging.getLogger(__name__)

#: how often the keeper re-checks without an event (the overrun rule needs a clock).
RECHECK_S = 1.0


@dataclass(frozen=True)
class GpuShareView:
    """What the keeper reads of one GPU: sharers' shares, gated members, the turn and its key."""

    shares: dict[str, float]
    members: frozenset[str]
    turn: Turn | None
    turn_kv: KeyValue | None
    memory_bytes: int = 0  # memory quotas of every job holding a slice of the GPU, summed

    @property
    def gated(self) -> dict[str, float]:
        """Members that hold a slice of the GPU, with their shares."""
        return {j: s for j, s in self.shares.items() if j in self.members}


def read_gpu(store: EtcdStore, keys: Keyspace, node: str, gpu_uuid: str) -> GpuShareView:
    """Read the GPU's allocations and time-slicing keys (two range reads)."""
    shares: dict[str, float] = {}
    memory = 0
    allocs, _ = store.get_prefix(keys.allocations_prefix(node) + gpu_uuid + "/")
    for kv in allocs:
        try:
            a = decode(kv.key, kv.value, Allocation)
        except SchemaError as e:
            log.warning("%s", e)
            continue
        if a.gpu_uuid == gpu_uuid:
            shares[a.job] = shares.get(a.job, 0.0) + a.compute_share
            memory += a.memory_bytes
    items, _ = store.get_prefix(keys.timeslice_prefix(node, gpu_uuid))
    members: set[str] = set()
    turn: Turn | None = None
    turn_kv: KeyValue | None = None
    turn_key = keys.timeslice_turn(node, gpu_uuid)
    for kv in items:
        if kv.key == turn_key:
            turn_kv = kv
            try:
                turn = decode(kv.key, kv.value, Turn)
            except SchemaError as e:
                log.warning("%s (replaced at the next hand-over)", e)
        else:
            parsed = keys.parse(kv.key)
            if parsed is not None and parsed.kind == "timeslice.member":
                members.add(parsed.parts[2])
    return GpuShareView(shares, frozenset(members), turn, turn_kv, memory)


def gpu_memory(store: EtcdStore, keys: Keyspace, node: str, gpu_uuid: str) -> int | None:
    """The GPU's memory from its published record, or None when it is absent or malformed."""
    try:
        got = store.get_record(keys.gpu(node, gpu_uuid), GpuInfo)
    except SchemaError as e:
        log.warning("%s", e)
        return None
    return got[0].memory_bytes if got else None


class TurnKeeper:
    """Keeps one job's part of one GPU's rotation (runs in the keeper process).

    Args:
        store: the etcd store.
        job: this job.
        node: the GPU's node.
        gpu_uuid: the GPU.
        send: called with each state message for the gate.
        settings: period and overrun.
        compute_share: weight override (None: the job's allocation's share).
        timing: the keeper lease's timing.
        clock: wall clock (``time.time``), injectable for tests.
    """

    def __init__(
        self,
        store: EtcdStore,
        job: str,
        node: str,
        gpu_uuid: str,
        send: Callable[[dict[str, Any]], None],
        settings: TimeSliceSettings | None = None,
        compute_share: float | None = None,
        timing: LeaseTiming | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.keys = store.keys
        self.job = job
        self.node = node
        self.gpu_uuid = gpu_uuid
        self.settings = settings or TimeSliceSettings()
        self.compute_share = compute_share
        self._send = send
        self._clock = clock
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._handing_over: int | None = None
        self._last_sent: dict[str, Any] | None = None
        self._lease_lost = threading.Event()
        self.lease = LeaseKeeper(store, timing or LeaseTiming(), on_lost=self._on_lost)
        self._watchers: list[Any] = []
        self.handovers = 0
        self._gpu_memory: int | None = None

    def _on_lost(self, err: GpupoolError) -> None:
        log.warning("time-slicing keeper of %s lost its lease (%s); registering again", self.job, err)
        self._lease_lost.set()
        self._wake.set()

    def start(self) -> None:
        """Take a lease, register as a member, start the watches."""
        lease_id = self.lease.start()
        self.store.put(self.keys.timeslice_member(self.node, self.gpu_uuid, self.job), {"job": self.job}, lease=lease_id)
        for prefix in (self.keys.allocations_prefix(self.node) + self.gpu_uuid + "/", self.keys.timeslice_prefix(self.node, self.gpu_uuid)):
            self._watchers.append(
                self.store.watch_prefix(prefix, lambda _events: self._wake.set(), on_resync=self._resync)
            )
        self._wake.set()

    def _resync(self) -> int | None:
        self._wake.set()
        return None

    def hand_over(self, seq: int) -> None:
        """The gate used up its quantum on turn ``seq`` (called from the pipe reader)."""
        with self._lock:
            self._handing_over = seq
        self._wake.set()

    def stop(self) -> None:
        """Stop the loop, cancel the watches and revoke the lease (membership and turn vanish)."""
        self._stop.set()
        self._wake.set()

    def run(self) -> None:
        """Reconcile on every wake until stopped; then clean up."""
        try:
            while not self._stop.is_set():
                self._wake.wait(RECHECK_S)
                self._wake.clear()
                if self._stop.is_set():
                    break
                try:
                    if self._lease_lost.is_set():
                        self._lease_lost.clear()
                        self.lease = LeaseKeeper(self.store, self.lease.timing, on_lost=self._on_lost)
                        lease_id = self.lease.start()
                        self.store.put(
                            self.keys.timeslice_member(self.node, self.gpu_uuid, self.job), {"job": self.job}, lease=lease_id
                        )
                    self.reconcile()
                except StoreError as e:
                    log.warning("time-slicing keeper of %s: %s; retrying", self.job, e)
                    time.sleep(0.2)
                    self._wake.set()
        finally:
            for w in self._watchers:
                w.cancel()
            try:
                self.lease.stop(revoke=True)
            except GpupoolError as e:  # pragma: no cover - etcd gone at exit
                log.warning("could not revoke the time-slicing lease: %s", e)

    def reconcile(self) -> None:
        """One pass: read, maybe write a new turn (CAS), tell the gate."""
        for _ in range(3):
            view = read_gpu(self.store, self.keys, self.node, self.gpu_uuid)
            if self._gpu_memory is None:
                self._gpu_memory = gpu_memory(self.store, self.keys, self.node, self.gpu_uuid)
            gated = view.gated
            if self.compute_share is not None and self.job in gated:
                gated[self.job] = self.compute_share
            with self._lock:
                handing = self._handing_over
            now = self._clock()
            new = plan_turn(self.job, gated, view.turn, now, self.settings, handing_over=handing)
            lease_id = self.lease.lease_id
            mine = view.turn is not None and view.turn.holder == self.job and view.turn_kv is not None
            if new is None and mine and view.turn_kv is not None and view.turn_kv.lease != lease_id and len(gated) >= 2:
                new = view.turn  # take the turn onto our lease: it dies with us
            if new is not None:
                key = self.keys.timeslice_turn(self.node, self.gpu_uuid)
                guard = (
                    Compare(key, "create", "==", 0)
                    if view.turn_kv is None
                    else Compare(key, "mod", "==", view.turn_kv.mod_revision)
                )
                ok = self.store.txn([guard], [Put(key, new, lease=lease_id)])
                if not ok:
                    continue  # someone else moved it: re-read
                if handing is not None and new.seq != (view.turn.seq if view.turn else 0):
                    self.handovers += 1
                    with self._lock:
                        if self._handing_over == handing:
                            self._handing_over = None
                view = GpuShareView(view.shares, view.members, new, None, view.memory_bytes)
            self._tell(view, gated)
            return
        self._wake.set()  # lost three races in a row: try again on the next pass

    def _tell(self, view: GpuShareView, gated: dict[str, float]) -> None:
        alone = len(gated) < 2 or self.job not in gated
        turn = view.turn
        msg = {
            "op": "state",
            "alone": alone,
            "holder": None if alone or turn is None else turn.holder,
            "seq": 0 if turn is None else turn.seq,
            "quantum_s": quantum_s(self.job, gated, self.settings.period_s),
            "members": len(gated),
            "fits": None if self._gpu_memory is None else view.memory_bytes <= self._gpu_memory,
        }
        if msg != self._last_sent:
            self._last_sent = msg
            self._send(msg)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m gpupool_sdk.client.timeslice_keeper FD`` with the config as first message."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m gpupool_sdk.client.timeslice_keeper FD (started by TimeSliceGate.start)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the training process decides; it closes the pipe
    conn = Connection(int(args[0]))
    cfg = conn.recv()
    level = cfg.get("log_level")
    if level is not None:
        logging.basicConfig(level=level, format="gpupool-timeslice %(levelname)s %(name)s: %(message)s")
    send_lock = threading.Lock()

    def send(msg: dict[str, Any]) -> None:
        with send_lock:
            try:
                conn.send(msg)
            except OSError:
                keeper.stop()

    store = EtcdStore(cfg["endpoints"], keyspace=Keyspace(cfg["prefix"]), security=cfg["security"])
    keeper = TurnKeeper(
        store, cfg["job"], cfg["node"], cfg["gpu_uuid"], send, settings=cfg["settings"], compute_share=cfg["compute_share"]
    )
    signal.signal(signal.SIGTERM, lambda *_: keeper.stop())
    try:
        keeper.start()
    except GpupoolError as e:
        conn.send({"op": "error", "message": str(e)})
        store.close()
        return 1
    send({"op": "ready", "pid": os.getpid()})
    parent = cfg.get("parent_pid")

    def read() -> None:
        while True:
            try:
                if not conn.poll(1.0):
                    if parent is not None and os.getppid() != parent:
                        break
                    continue
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, dict) and msg.get("op") == "done":
                keeper.hand_over(int(msg["seq"]))
            elif isinstance(msg, dict) and msg.get("op") == "bye":
                break
        keeper.stop()

    threading.Thread(target=read, name="gpupool-timeslice-pipe", daemon=True).start()
    try:
        keeper.run()
    finally:
        store.close()
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
