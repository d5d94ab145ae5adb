"""The fault-injection engine: a real pool on loopback, faults injected, invariants checked.

Everything is a real process: etcd (one member, restarted on its data dir, or a 3-member raft
group), ``gpupool coordinator`` replicas, ``gpupool agent --simulate`` agents, and job clients
(``fault_client.py``: ``PoolClient`` with its I/O helper, in a process group of their own).
Faults are injected one after another with real signals (see :data:`KINDS`); garbage and hostile
records are written under every key kind. Checked while it runs and after:

* **capacity**, polled at about 10 Hz: on every GPU an agent publishes, the memory of every
  allocation present (orphans included) fits the GPU, compute shares sum to <= 1, an exclusive
  slice is alone, and nothing is ever allocated on a GPU no agent publishes or to a spec without
  a lease;
* **exclusivity as the jobs saw it**: from each client's own log, no two clients believed they
  held the same GPU at overlapping times when one of them held it exclusively;
* **fencing**: the etcd history is replayed; every leader-owned write (status, allocation,
  directive) carries the term of the leader key and term counter at its revision; leader terms
  only grow;
* **orphans**: after the grace, no allocation or status without a live spec on the same lease;
* **liveness**: once the faults stop, every client is granted again.

Used by ``tests/faults/test_faults.py`` (short runs) and ``scripts/faults.py --duration`` (long).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpupool_sdk.errors import GpupoolError, SchemaError
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import (
    Allocation,
    Directive,
    GiB,
    GpuInfo,
    JobSpec,
    JobState,
    JobStatus,
    LeaderRecord,
    QoS,
)
from gpupool_sdk.store import EtcdCluster, EtcdServer, EtcdStore, Keyspace
from gpupool_sdk.store.codec import decode, decode_dict
from gpupool_sdk.store.types import WatchEvent

ROOT = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).with_name("fault_client.py")

#: Fault kinds for a single-member etcd and for a 3-member one.
SINGLE_KINDS = (
    "kill_leader", "stop_leader", "kill_agent", "stop_agent", "kill_client", "kill_client_with_helper",
    "stop_client", "revoke_client", "kill_etcd", "kill_etcd_past_ttl", "garbage",
)
CLUSTER_KINDS = (
    "kill_leader", "stop_leader", "kill_agent", "kill_client", "kill_client_with_helper", "revoke_client",
    "kill_member", "kill_raft_leader", "stop_member", "garbage",
)
KINDS = tuple(dict.fromkeys(SINGLE_KINDS + CLUSTER_KINDS))


@dataclass
class FaultConfig:
    """One fault run.

    Attributes:
        duration_s: how long faults are injected (after every client was served once).
        etcd_members: 1 (killed and restarted on its data dir) or 3 (members killed one at a time).
        coordinators: coordinator replicas.
        nodes: one simulated agent per entry (``--simulate`` syntax).
        clients: job clients (exclusive and guaranteed jobs, one GPU each).
        gap_s: pause between two faults.
        seed: order of the faults and the clients' hold times.
        coord_ttl: the coordinators' lease TTL (failover is checked against 2 x this).
        settle_s: bound on waiting for every client to be served again once faults stop.
        every_kind: go on past ``duration_s`` until every fault kind was injected at least once.
    """

    duration_s: float = 40.0
    etcd_members: int = 1
    coordinators: int = 3
    nodes: tuple[str, ...] = ("node-a:4xH100-80GB:nvlink", "node-b:4xH100-80GB:nvlink")
    clients: int = 8
    gap_s: float = 1.5
    seed: int = 1
    coord_ttl: int = 3
    settle_s: float = 120.0
    kinds: tuple[str, ...] = ()
    every_kind: bool = True

    def fault_kinds(self) -> tuple[str, ...]:
        return self.kinds or (SINGLE_KINDS if self.etcd_members == 1 else CLUSTER_KINDS)


@dataclass
class Report:
    """What a run did and found (``violations`` empty means every invariant held)."""

    config: dict[str, Any]
    faults: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    samples: int = 0
    grants: int = 0
    history_events: int = 0
    failover_s: list[float] = field(default_factory=list)
    failover_first_grant_s: list[float] = field(default_factory=list)
    failover_events: list[dict[str, Any]] = field(default_factory=list)
    etcd_restart_first_grant_s: list[float] = field(default_factory=list)
    settle_s: float = 0.0
    duration_s: float = 0.0
    client_errors: dict[str, int] = field(default_factory=dict)
    #: injected orphans written onto a GPU already in use (the injection's overcommit, not a grant's).
    injected_collisions: int = 0
    #: processes that exited on their own and were restarted, as a supervisor would: name -> last log line.
    supervisor_restarts: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        def q(xs: list[float], p: float) -> float | None:
            if not xs:
                return None
            s = sorted(xs)
            return round(s[min(len(s) - 1, int(round(p * (len(s) - 1))))], 2)

        return {
            "faults": dict(sorted(self.faults.items())),
            "faults_total": sum(self.faults.values()),
            "violations": len(self.violations),
            "capacity_samples": self.samples,
            "grants_seen_by_clients": self.grants,
            "history_events_replayed": self.history_events,
            "failover_new_leader_s": {"n": len(self.failover_s), "p50": q(self.failover_s, 0.5),
                                      "p99": q(self.failover_s, 0.99), "max": q(self.failover_s, 1.0)},
            "failover_first_grant_s": {"n": len(self.failover_first_grant_s),
                                       "p50": q(self.failover_first_grant_s, 0.5),
                                       "p99": q(self.failover_first_grant_s, 0.99),
                                       "max": q(self.failover_first_grant_s, 1.0)},
            "etcd_restart_first_grant_s": {"n": len(self.etcd_restart_first_grant_s),
                                           "p50": q(self.etcd_restart_first_grant_s, 0.5),
                                           "max": q(self.etcd_restart_first_grant_s, 1.0)},
            "failover_events": self.failover_events,
            "settle_s": round(self.settle_s, 2),
            "client_errors": dict(sorted(self.client_errors.items())),
            "injected_collisions": self.injected_collisions,
            "supervisor_restarts": len(self.supervisor_restarts),
        }


@dataclass
class _Proc:
    name: str
    args: list[str]
    popen: subprocess.Popen[bytes] | None = None
    stopped: bool = False


class FaultRun:
    """Runs one :class:`FaultConfig` in ``workdir`` (logs, etcd data, client logs, report.json)."""

    def __init__(self, config: FaultConfig, workdir: Path, log: Callable[[str], None] = print) -> None:
        self.cfg = config
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.say = log
        self.rng = random.Random(config.seed)
        self.keys = Keyspace(f"/gpupool-faults/{uuid.uuid4().hex[:12]}")
        self.report = Report(config=asdict(config))
        self.procs: dict[str, _Proc] = {}
        self.etcd: EtcdServer | None = None
        self.cluster: EtcdCluster | None = None
        self.store: EtcdStore | None = None
        self.gpus = [g for spec in config.nodes for g in parse_cluster_spec(spec)]
        self.node_of_agent = [parse_cluster_spec(spec)[0].node for spec in config.nodes]
        self._lock = threading.Lock()
        self._samples: list[tuple[float, str | None, int, int, float]] = []  # t, leader id, leader term, max alloc term, max granted_at
        self._sampling = threading.Event()
        self._excluded_revisions: set[int] = set()  # our own hostile writes (not the leader's)
        self._collision_seen: dict[str, int] = {}
        self._breaches: set[str] = set()
        self._kills: list[tuple[float, str]] = []  # (time, client name) when a client process was killed
        self._revokes: list[tuple[float, str]] = []  # (time, client name) when a held lease was revoked
        self._leader_faults: list[tuple[float, int, str]] = []  # (time, term of the leader it hit, kind)
        self._etcd_up: list[float] = []
        self.start_revision = 0

    # ------------------------------------------------------------------ processes

    @property
    def endpoints(self) -> str:
        if self.cluster is not None:
            return self.cluster.endpoints
        assert self.etcd is not None
        return self.etcd.endpoint

    def _spawn(self, p: _Proc) -> None:
        out = open(self.dir / f"{p.name}.log", "ab")  # noqa: SIM115 - owned by the process
        p.popen = subprocess.Popen(
            [sys.executable, *p.args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        out.close()
        p.stopped = False

    def _add(self, name: str, args: list[str]) -> _Proc:
        p = self.procs[name] = _Proc(name, args)
        self._spawn(p)
        return p

    def _signal(self, p: _Proc, sig: int, group: bool = True) -> None:
        if p.popen is None or p.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(p.popen.pid, sig)
            else:
                os.kill(p.popen.pid, sig)

    def _kill(self, p: _Proc, group: bool = True) -> None:
        self._signal(p, signal.SIGKILL, group)
        if p.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(10)

    def _restart(self, p: _Proc) -> None:
        if p.popen is not None and p.popen.poll() is None:
            self._kill(p)
        self._spawn(p)

    def _supervise(self) -> None:
        """Restart processes that exited on their own, as systemd or Kubernetes would.

        ``gpupool coordinator`` and ``gpupool agent`` exit (code 3) when etcd is unreachable as they
        start, by design (a wrong --endpoints fails fast); a restart during an etcd outage hits that.
        """
        for p in self.procs.values():
            if p.popen is None or p.popen.poll() is None:
                continue
            tail = (self.dir / f"{p.name}.log").read_text(errors="replace").strip().splitlines()[-1:] or ["?"]
            self.report.supervisor_restarts.append(f"{p.name} exited {p.popen.returncode}: {tail[0][:200]}")
            self.say(f"  supervisor: {p.name} exited with {p.popen.returncode}; restarting it")
            self._spawn(p)

    def _start_etcd(self) -> None:
        if self.cfg.etcd_members == 1:
            self.etcd = EtcdServer(data_dir=self.dir / "etcd", die_with_parent=False)
            self.etcd.start(timeout=90)
        else:
            # No fork-time hook: this process runs gRPC, and members are restarted from it.
            self.cluster = EtcdCluster(self.cfg.etcd_members, data_root=self.dir / "etcd-cluster", die_with_parent=False)
            self.cluster.start(timeout=90)

    def _start_pool(self) -> None:
        ep, prefix = self.endpoints, self.keys.prefix
        for i in range(self.cfg.coordinators):
            self._add(f"coordinator-c{i}", [
                "-m", "gpupool_sdk.cli.main", "coordinator", "--endpoints", ep, "--prefix", prefix, "--id", f"c{i}",
                "--ttl", str(self.cfg.coord_ttl), "--loop-wait", "0.5", "--retry-timeout", "0.75", "--log-level", "info",
            ])
        for i, spec in enumerate(self.cfg.nodes):
            self._add(f"agent-{i}", [
                "-m", "gpupool_sdk.cli.main", "agent", "--endpoints", ep, "--prefix", prefix, "--simulate", spec,
                "--ttl", "6", "--refresh", "0.5", "--log-level", "info",
            ])

    def _start_clients(self) -> None:
        ep, prefix = self.endpoints, self.keys.prefix
        per_node = {n: [g for g in self.gpus if g.node == n] for n in self.node_of_agent}
        for i in range(self.cfg.clients):
            node = self.node_of_agent[i % len(self.node_of_agent)]
            mem = per_node[node][0].memory_bytes
            if i % 2 == 0:
                spec = JobSpec(name=f"fc{i}", gpus=1, memory=mem, qos="exclusive")
            else:
                spec = JobSpec(name=f"fc{i}", gpus=1, memory=mem // 2 - GiB, qos="guaranteed", compute_share=0.5)
            self._add(f"client-fc{i}", [str(CLIENT), ep, prefix, node, json.dumps(spec.to_dict()),
                                        str(self.dir / f"fc{i}.jsonl"), str(self.cfg.seed * 100 + i)])

    def _stop_all(self) -> None:
        for p in self.procs.values():
            if p.stopped:
                self._signal(p, signal.SIGCONT)
        for p in reversed(list(self.procs.values())):
            self._signal(p, signal.SIGTERM)
        for p in self.procs.values():
            if p.popen is None:
                continue
            try:
                p.popen.wait(15)
            except subprocess.TimeoutExpired:
                self._kill(p)
        # Helpers left behind by killed clients (own session: the client's group) are gone with
        # SIGKILL of the group; a helper that stays to finish revocations exits within its bound.

    # ------------------------------------------------------------------ reads

    def _leader(self) -> tuple[str | None, int]:
        assert self.store is not None
        try:
            got = self.store.get_record(self.keys.leader(), LeaderRecord)
        except (GpupoolError, SchemaError):
            return None, 0
        return (got[0].id, got[0].term) if got else (None, 0)

    def _wait(self, cond: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                v = cond()
            except GpupoolError:
                v = None
            if v:
                return v
            time.sleep(0.1)
        raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")

    def client_events(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for i in range(self.cfg.clients):
            path = self.dir / f"fc{i}.jsonl"
            evs: list[dict[str, Any]] = []
            if path.exists():
                for line in path.read_text(errors="replace").splitlines():
                    with contextlib.suppress(ValueError):
                        evs.append(json.loads(line))
            out[f"fc{i}"] = evs
        return out

    # ------------------------------------------------------------------ sampler (~10 Hz)

    def _sample_loop(self) -> None:
        store = EtcdStore(self.endpoints, keyspace=self.keys, timeout_s=1.0)
        ks = self.keys
        valid_gpus = {g.uuid for g in self.gpus}
        try:
            while not self._sampling.is_set():
                t0 = time.monotonic()
                try:
                    kvs, rev = store.get_prefix(ks.root())
                except GpupoolError:
                    time.sleep(0.1)
                    continue
                now = time.time()
                self._check_capacity(kvs, rev, valid_gpus, now)
                elapsed = time.monotonic() - t0
                time.sleep(max(0.0, 0.1 - elapsed))
        finally:
            store.close()

    def _check_capacity(self, kvs: list[Any], rev: int, valid_gpus: set[str], now: float) -> None:
        ks = self.keys
        gpus: dict[str, tuple[GpuInfo, int]] = {}
        node_lease: dict[str, int] = {}
        allocs: list[tuple[Allocation, int, int]] = []  # allocation, lease, mod revision
        spec_lease: dict[str, int] = {}
        leader_id, leader_term = None, 0
        for kv in kvs:
            p = ks.parse(kv.key)
            if p is None:
                continue
            try:
                if p.kind == "gpus":
                    gpus[p.parts[1]] = (decode(kv.key, kv.value, GpuInfo), kv.lease)
                elif p.kind == "nodes":
                    node_lease[p.parts[0]] = kv.lease
                elif p.kind == "allocations":
                    allocs.append((decode(kv.key, kv.value, Allocation), kv.lease, kv.mod_revision))
                elif p.kind == "jobs.spec":
                    spec_lease[p.parts[0]] = kv.lease
                elif p.kind == "leader":
                    rec = decode(kv.key, kv.value, LeaderRecord)
                    leader_id, leader_term = rec.id, rec.term
            except SchemaError:
                continue
        violations: list[str] = []
        by_gpu: dict[str, list[tuple[Allocation, int]]] = {}
        for a, _lease, mod in allocs:
            by_gpu.setdefault(a.gpu_uuid, []).append((a, mod))
            if a.gpu_uuid not in valid_gpus:
                violations.append(f"rev {rev}: {a.job} holds {a.gpu_uuid}, a GPU no agent publishes")
            if a.job.startswith("hostile-"):
                violations.append(f"rev {rev}: hostile spec {a.job} (no lease / another job's name) was granted")
        for uuid_, entries in by_gpu.items():
            got = gpus.get(uuid_)
            if got is None or uuid_ not in valid_gpus:
                continue
            g = got[0]
            # An orphan this run wrote by hand onto a GPU already in use is our collision, not a
            # grant: count an injected orphan only when some grant there came after it.
            last_grant = max((mod for a, mod in entries if not a.job.startswith("ghost-")), default=0)
            held = [a for a, mod in entries if not a.job.startswith("ghost-") or mod < last_grant]
            if len(held) < len(entries) and self._collision_seen.setdefault(uuid_ + str(last_grant), rev) == rev:
                self.report.injected_collisions += 1
            jobs = sorted(a.job for a in held)
            mem = sum(a.memory_bytes for a in held)
            if mem > g.memory_bytes:
                violations.append(f"rev {rev}: GPU {uuid_} has {mem / GiB:.1f} GiB granted on {g.memory_bytes / GiB:.0f} GiB {jobs}")
            share = sum(a.compute_share for a in held if a.mode is not QoS.SHARED)
            if share > 1.0 + 1e-9:
                violations.append(f"rev {rev}: GPU {uuid_} compute shares sum to {share:.2f} {jobs}")
            if any(a.mode is QoS.EXCLUSIVE for a in held) and len(held) > 1:
                violations.append(f"rev {rev}: exclusive slice on {uuid_} shares it with {jobs}")
        max_term = max((a.term for a, _, _ in allocs), default=0)
        max_granted = max((a.granted_at or 0.0 for a, _, _ in allocs), default=0.0)
        with self._lock:
            self.report.samples += 1
            self._samples.append((now, leader_id, leader_term, max_term, max_granted))
            for v in violations:
                # One entry per GPU and kind of breach (the first revision seen), not one per sample.
                what = v.split(": ", 1)[1].split(" has ")[0].split(" compute")[0].split(" shares")[0]
                if what not in self._breaches:
                    self._breaches.add(what)
                    self.report.violations.append("capacity: " + v)

    # ------------------------------------------------------------------ faults

    def _leader_proc(self) -> tuple[_Proc | None, int]:
        lid, term = self._leader()
        if lid is None:
            return None, 0
        return self.procs.get(f"coordinator-{lid}"), term

    def _client(self) -> _Proc:
        return self.procs[f"client-fc{self.rng.randrange(self.cfg.clients)}"]

    def _inject(self, kind: str) -> bool:
        """Run one fault and its recovery; False when it could not apply now (no leader...)."""
        cfg = self.cfg
        if kind in ("kill_leader", "stop_leader"):
            p, term = self._leader_proc()
            if p is None:
                return False
            self._leader_faults.append((time.time(), term, kind))
            if kind == "kill_leader":
                self._kill(p)
                time.sleep(1.0)
                self._restart(p)
            else:
                self._signal(p, signal.SIGSTOP)
                p.stopped = True
                time.sleep(cfg.coord_ttl + 1.5)  # paused past its lease: it must step down on waking
                self._signal(p, signal.SIGCONT)
                p.stopped = False
            # One fault at a time: the next waits for the new leader (else its latency would
            # include, say, an etcd outage injected before the election could finish).
            with contextlib.suppress(TimeoutError):
                self._wait(lambda: self._leader()[1] > term, 60, "a new leader")
            return True
        if kind in ("kill_agent", "stop_agent"):
            i = self.rng.randrange(len(cfg.nodes))
            p = self.procs[f"agent-{i}"]
            node = self.node_of_agent[i]
            assert self.store is not None
            try:
                before = self.store.get(self.keys.node(node))
            except GpupoolError:
                before = None
            old_lease = before.lease if before is not None else None
            if kind == "kill_agent":
                self._kill(p)
                time.sleep(1.0)
                self._restart(p)
            else:
                self._signal(p, signal.SIGSTOP)
                time.sleep(2.0)
                self._signal(p, signal.SIGCONT)
            # One fault at a time: wait until the node's GPUs are published again (a restarted
            # agent needs a Python start-up, tens of seconds on a busy machine). After a kill,
            # by the new process: the killed one's keys outlive it by its TTL, and an etcd fault
            # injected while the new one still starts makes it exit (a first registration that
            # cannot reach etcd fails fast, by design), leaving the node's jobs without GPUs.
            want = {g.uuid for g in self.gpus if g.node == node}

            def republished() -> bool:
                kvs = self.store.get_prefix(self.keys.gpus_prefix(node))[0]  # type: ignore[union-attr]
                return want <= {kv.key.rsplit("/", 1)[-1] for kv in kvs
                                if kind == "stop_agent" or old_lease is None or kv.lease != old_lease}

            with contextlib.suppress(TimeoutError):
                self._wait(republished, 90, f"node {node}'s GPUs to be published again")
            return True
        if kind in ("kill_client", "kill_client_with_helper"):
            p = self._client()
            with self._lock:
                self._kills.append((time.time(), p.name.removeprefix("client-")))
            # Without the helper: only the training process dies; its helper revokes at once.
            self._kill(p, group=kind == "kill_client_with_helper")
            time.sleep(0.5)
            if kind == "kill_client":
                time.sleep(1.0)  # let the orphaned helper notice and revoke before the next incarnation
            self._restart(p)
            return True
        if kind == "revoke_client":
            return self._revoke_client()
        if kind == "stop_client":
            p = self._client()
            self._signal(p, signal.SIGSTOP, group=False)  # the trainer freezes, its helper keeps the lease
            time.sleep(2.0)
            self._signal(p, signal.SIGCONT, group=False)
            return True
        if kind in ("kill_etcd", "kill_etcd_past_ttl"):
            assert self.etcd is not None
            self.etcd.kill()
            time.sleep(2.0 if kind == "kill_etcd" else 7.0)  # the clients' TTL is 5 s
            self.etcd.start(timeout=90)
            self._etcd_up.append(time.time())
            return True
        if kind in ("kill_member", "kill_raft_leader", "stop_member"):
            assert self.cluster is not None
            if kind == "kill_raft_leader":
                raft_leader = self.cluster.leader_index()
                if raft_leader is None:
                    return False
                m = raft_leader
            else:
                m = self.rng.randrange(len(self.cluster.members))
            if kind == "stop_member":
                self.cluster.signal(m, signal.SIGSTOP)
                time.sleep(3.0)
                self.cluster.signal(m, signal.SIGCONT)
            else:
                self.cluster.kill(m)
                time.sleep(3.0)
                self.cluster.start_member(m, timeout=90)
            return True
        if kind == "garbage":
            self._garbage()
            return True
        raise ValueError(f"unknown fault kind {kind!r}")

    def _granted_clients(self) -> list[tuple[str, int]]:
        """(client name, etcd lease) of every client whose job is GRANTED now."""
        assert self.store is not None
        out = []
        for i in range(self.cfg.clients):
            name = f"fc{i}"
            kv = self.store.get(self.keys.job_spec(name))
            try:
                got = self.store.get_record(self.keys.job_status(name), JobStatus)
            except SchemaError:
                continue
            if kv is not None and kv.lease and got is not None and got[0].state is JobState.GRANTED:
                out.append((name, kv.lease))
        return out

    def _revoke_client(self) -> bool:
        """Revoke a granted client's etcd lease through the etcd API, as a forced preemption does
        (or as etcd expires the lease of a helper starved past its TTL): the client must notice,
        stop, and be granted again under its name on a new lease by itself."""
        assert self.store is not None
        try:
            held = self._granted_clients()
        except GpupoolError:
            return False
        if not held:
            return False
        name, lease = held[self.rng.randrange(len(held))]
        t0 = time.time()
        with self._lock:
            self._revokes.append((t0, name))
        try:
            self.store.revoke_lease(lease)
        except GpupoolError:
            return False
        # One fault at a time: wait until that client is granted again (the end-of-run liveness
        # check reports it if it never is).
        with contextlib.suppress(TimeoutError):
            self._wait(lambda: any(e["ev"] == "granted" and e["t"] > t0 for e in self.client_events()[name]),
                       60, f"{name} to be granted again after its lease was revoked")
        return True

    def _garbage(self) -> None:
        """Garbage under every key kind, and hostile records that parse (failures 1-3 of issue 12)."""
        assert self.store is not None
        ks, st = self.keys, self.store
        tag = uuid.uuid4().hex[:6]
        real = self.gpus[self.rng.randrange(len(self.gpus))]
        raw = {
            ks.node(f"garbage-{tag}"): b"{oops",
            ks.gpu(f"garbage-{tag}", f"GPU-garbage-{tag}"): b'{"schema": 1, "kind": "GpuInfo", "memory_bytes": NaN}',
            ks.job_spec(f"garbage-{tag}"): b'{"schema": 99}',
            ks.job_status(f"garbage-{tag}"): b"[]",
            ks.allocation(real.node, real.uuid, f"garbage-{tag}"): b'{"schema": 1, "kind": "Allocation", "memory_bytes": -1}',
            ks.directive(f"garbage-{tag}"): b"x" * (1 << 20),
            ks.ack(f"garbage-{tag}"): b"null",
            ks.telemetry(f"garbage-{tag}"): b'{"schema": 1, "summary": {"memory_peak_bytes": 1e999}}',
            ks.checkpoint(f"garbage-{tag}"): b"{}",
            ks.usage(f"garbage-{tag}"): b"not json",
        }
        try:
            for key, value in raw.items():
                self._excluded_revisions.add(st.put(key, value))
            # A spec without a lease, and one that names another job.
            self._excluded_revisions.add(st.put(ks.job_spec(f"hostile-{tag}"),
                                                JobSpec(name=f"hostile-{tag}", gpus=1, memory="1GiB")))
            lease = st.grant_lease(30)
            self._excluded_revisions.add(st.put(ks.job_spec(f"hostile-x{tag}"),
                                                JobSpec(name="fc0", gpus=1, memory="1GiB"), lease=lease))
            # A GPU key nobody publishes: no lease, no node key, unknown model, 2^60 bytes.
            rogue = GpuInfo(uuid=f"GPU-rogue-{tag}", node=f"rogue-{tag}", index=0, model="H999-1EB", memory_bytes=1 << 60)
            self._excluded_revisions.add(st.put(ks.gpu(rogue.node, rogue.uuid), rogue))
            # An orphaned allocation with no lease: counted as used until the leader deletes it.
            ghost = Allocation(f"ghost-{tag}", real.node, real.uuid, real.index, 41 * GiB, 0.5, QoS.GUARANTEED, 1, time.time())
            self._excluded_revisions.add(st.put(ks.allocation(real.node, real.uuid, ghost.job), ghost))
            status = JobStatus(JobState.GRANTED, "by hand", term=1, gpus=1)
            self._excluded_revisions.add(st.put(ks.job_status(ghost.job), status))
        except GpupoolError as exc:
            self.say(f"garbage injection partly failed: {exc}")

    # ------------------------------------------------------------------ checks after the run

    def _replay_history(self) -> None:
        """Fencing: every leader-owned write carries the term of the leader key at its revision."""
        store = EtcdStore(self.endpoints, keyspace=self.keys, timeout_s=5.0)
        ks = self.keys
        events: list[WatchEvent] = []
        done = threading.Event()
        last = store.revision()

        def on_events(batch: list[WatchEvent]) -> None:
            events.extend(batch)
            if batch and batch[-1].kv.mod_revision >= last:
                done.set()

        w = store.watch_prefix(ks.root(), on_events, start_revision=self.start_revision)
        try:
            # Not every revision touches the prefix: stop once the stream is quiet and caught up.
            quiet = 0
            seen = -1
            while not done.is_set() and quiet < 30:
                time.sleep(0.2)
                quiet = quiet + 1 if len(events) == seen else 0
                seen = len(events)
        finally:
            w.cancel()
            store.close()
        self.report.history_events = len(events)
        counter = 0
        leader_term: int | None = None
        last_leader_term = 0
        bad: list[str] = []
        for ev in events:
            kv = ev.kv
            p = ks.parse(kv.key)
            if p is None:
                continue
            rev = kv.mod_revision
            if p.kind == "term" and ev.type == "put":
                with contextlib.suppress(SchemaError):
                    counter = int(decode_dict(kv.key, kv.value).get("term", 0))
                continue
            if p.kind == "leader":
                if ev.type == "delete":
                    leader_term = None
                    continue
                try:
                    rec = decode(kv.key, kv.value, LeaderRecord)
                except SchemaError:
                    leader_term = None
                    continue
                if kv.version == 1:  # a new leader key (renewals rewrite the same one)
                    if rec.term <= last_leader_term:
                        bad.append(f"leader key at rev {rev} has term {rec.term}, not above the previous {last_leader_term}")
                    last_leader_term = max(last_leader_term, rec.term)
                leader_term = rec.term
                continue
            if ev.type != "put" or rev in self._excluded_revisions:
                continue
            cls = {"allocations": Allocation, "jobs.status": JobStatus, "directives": Directive}.get(p.kind)
            if cls is None:
                continue
            try:
                rec_term = int(getattr(decode(kv.key, kv.value, cls), "term", 0))
            except SchemaError:
                continue
            if leader_term is None or rec_term != leader_term or rec_term != counter:
                bad.append(f"stale write at rev {rev}: {kv.key} carries term {rec_term}, leader key term "
                           f"{leader_term}, term counter {counter}")
        self.report.violations.extend("fencing: " + b for b in bad[:50])

    def _check_beliefs(self) -> None:
        """No two clients believed they held one GPU at once when either held it exclusively."""
        kills: dict[str, list[float]] = {}
        for t, name in self._kills:
            kills.setdefault(name, []).append(t)
        # A revoked lease is the pool taking the slices back (forced preemption): the holder's
        # claim ends there, even though it learns of it a watch event later.
        revokes: dict[str, list[float]] = {}
        for t, name in self._revokes:
            revokes.setdefault(name, []).append(t)
        spans: list[tuple[float, float, str, str, str]] = []  # start, end, client, gpu, qos
        for name, evs in self.client_events().items():
            open_: dict[str, Any] | None = None
            end_marks = sorted(kills.get(name, []))
            revoke_marks = sorted(revokes.get(name, []))
            for e in evs:
                if e["ev"] == "granted":
                    if open_ is not None:  # restarted after a kill: the old belief ended at the kill
                        end = next((k for k in end_marks if k >= open_["t"]), e["t"])
                        spans.extend((open_["t"], end, name, g, open_["qos"]) for g in open_["gpus"])
                    open_ = e
                    self.report.grants += 1
                elif e["ev"] in ("releasing", "lost", "exit", "start") and open_ is not None:
                    end = e["t"]
                    if e["ev"] == "start":  # a new process: the old one was killed
                        end = next((k for k in end_marks if k >= open_["t"]), e["t"])
                    elif e["ev"] == "lost":
                        end = min(end, next((k for k in revoke_marks if k >= open_["t"]), end))
                    spans.extend((open_["t"], end, name, g, open_["qos"]) for g in open_["gpus"])
                    open_ = None
                elif e["ev"] == "error":
                    key = e.get("error", "?")
                    self.report.client_errors[key] = self.report.client_errors.get(key, 0) + 1
            if open_ is not None:
                end = next((k for k in end_marks if k >= open_["t"]), float("inf"))
                spans.extend((open_["t"], end, name, g, open_["qos"]) for g in open_["gpus"])
        by_gpu: dict[str, list[tuple[float, float, str, str, str]]] = {}
        for s in spans:
            by_gpu.setdefault(s[3], []).append(s)
        for gpu, ss in by_gpu.items():
            ss.sort()
            for i, a in enumerate(ss):
                for b in ss[i + 1:]:
                    if b[0] >= a[1]:
                        break
                    if a[2] != b[2] and "exclusive" in (a[4], b[4]):
                        self.report.violations.append(
                            f"exclusivity: {a[2]} ({a[4]}) believed it held {gpu} from {a[0]:.3f} to {a[1]:.3f} and "
                            f"{b[2]} ({b[4]}) from {b[0]:.3f} to {b[1]:.3f}")

    def _check_orphans(self) -> None:
        assert self.store is not None
        ks = self.keys
        kvs, rev = self.store.get_prefix(ks.root())
        specs = {}
        for kv in kvs:
            p = ks.parse(kv.key)
            if p is not None and p.kind == "jobs.spec" and kv.lease:
                specs[p.parts[0]] = kv.lease
        for kv in kvs:
            p = ks.parse(kv.key)
            if p is None or p.kind not in ("allocations", "jobs.status"):
                continue
            job = p.parts[-1] if p.kind == "allocations" else p.parts[0]
            if job.startswith("garbage-"):
                continue  # malformed values: reported and skipped, not the leader's to delete
            if not kv.lease or specs.get(job) != kv.lease:
                self.report.violations.append(f"orphan after the grace: {kv.key} (lease {kv.lease:x}) at rev {rev}")

    def _latencies(self) -> None:
        with self._lock:
            samples = list(self._samples)
        ttl2 = 2 * self.cfg.coord_ttl
        for t0, term, kind in self._leader_faults:
            after = [s for s in samples if s[0] >= t0]
            new = next((s for s in after if s[1] is not None and s[2] > term), None)
            grant = next((s for s in after if s[3] > term), None)
            self.report.failover_events.append({
                "kind": kind, "term": term, "new_leader_s": None if new is None else round(new[0] - t0, 2),
                "first_grant_s": None if grant is None else round(grant[0] - t0, 2)})
            if new is not None:
                self.report.failover_s.append(new[0] - t0)
                if new[0] - t0 > ttl2:
                    self.report.violations.append(
                        f"failover: new leader {new[0] - t0:.1f}s after the fault on term {term}, above 2 x TTL = {ttl2}s")
            else:
                self.report.violations.append(f"failover: no new leader after the fault on term {term}")
            if grant is not None:
                self.report.failover_first_grant_s.append(grant[0] - t0)
        for up in self._etcd_up:
            first = next((s for s in samples if s[0] >= up and s[4] >= up), None)
            if first is not None:
                self.report.etcd_restart_first_grant_s.append(first[0] - up)

    # ------------------------------------------------------------------ the run

    def run(self) -> Report:
        t_begin = time.monotonic()
        sampler = threading.Thread(target=self._sample_loop, name="capacity-sampler", daemon=True)
        try:
            self._start_etcd()
            self.store = EtcdStore(self.endpoints, keyspace=self.keys, timeout_s=2.0)
            self.start_revision = self.store.revision() + 1
            self._start_pool()
            self._wait(lambda: self._leader()[0], 120, "a leader")
            want = {g.uuid for g in self.gpus}
            self._wait(lambda: want <= {kv.key.rsplit("/", 1)[-1] for kv in self.store.get_prefix(self.keys.gpus_prefix())[0]},  # type: ignore[union-attr]
                       120, "the agents to publish their GPUs")
            self._start_clients()
            sampler.start()
            self._wait(lambda: all(any(e["ev"] == "granted" for e in evs) for evs in self.client_events().values()),
                       180, "every client to be served once")
            self.say(f"pool up ({time.monotonic() - t_begin:.0f}s): {self.cfg.clients} clients served; injecting faults "
                     f"for {self.cfg.duration_s:g}s")
            kinds = list(self.cfg.fault_kinds())
            order: list[str] = []
            t_faults = time.monotonic()
            t_end = t_faults + self.cfg.duration_s
            while time.monotonic() < t_end or (self.cfg.every_kind and set(kinds) - set(self.report.faults)):
                if not order:
                    order = kinds[:]
                    self.rng.shuffle(order)
                kind = order.pop()
                self._supervise()
                if self._inject(kind):
                    self.report.faults[kind] = self.report.faults.get(kind, 0) + 1
                    self.say(f"  fault {sum(self.report.faults.values())}: {kind} "
                             f"(t+{time.monotonic() - t_faults:.0f}s)")
                time.sleep(self.cfg.gap_s)
            # Liveness: every client served again once the faults stopped (after the orphan grace too).
            t_stop = time.time()

            def served_again() -> bool:
                # Still supervised, as systemd or Kubernetes would: a process that exited during
                # the last fault is restarted now too.
                self._supervise()
                return all(any(e["ev"] == "granted" and e["t"] > t_stop for e in evs)
                           for evs in self.client_events().values())

            try:
                self._wait(served_again, self.cfg.settle_s, "every client to be granted again after the faults")
            except TimeoutError:
                starved = [n for n, evs in self.client_events().items()
                           if not any(e["ev"] == "granted" and e["t"] > t_stop for e in evs)]
                self.report.violations.append(f"liveness: not granted again within {self.cfg.settle_s:g}s: {starved}")
            self.report.settle_s = time.time() - t_stop
            time.sleep(max(0.0, 2 * self.cfg.coord_ttl + 6 - (time.time() - t_stop)))  # the orphan grace (2 x TTL)
            self._sampling.set()
            sampler.join(10)
            self._check_orphans()
        finally:
            self._sampling.set()
            self._stop_all()
        try:
            self._replay_history()
        finally:
            if self.store is not None:
                self.store.close()
            if self.etcd is not None:
                self.etcd.stop()
            if self.cluster is not None:
                self.cluster.stop()
        self._check_beliefs()
        self._latencies()
        self.report.duration_s = time.monotonic() - t_begin
        (self.dir / "report.json").write_text(json.dumps({"figures": self.report.figures(),
                                                          "violations": self.report.violations}, indent=2))
        return self.report


def summarize(report: Report) -> str:
    """The figures as a few readable lines."""
    f = report.figures()
    lines = [
        f"faults: {f['faults_total']} ({', '.join(f'{k} {v}' for k, v in f['faults'].items())})",
        f"violations: {f['violations']}",
        f"capacity samples: {f['capacity_samples']}, grants seen by clients: {f['grants_seen_by_clients']}, "
        f"history events replayed: {f['history_events_replayed']}",
        f"new leader after a leader fault (s): {f['failover_new_leader_s']}",
        f"first grant after a leader fault (s): {f['failover_first_grant_s']}",
        f"first grant after an etcd restart (s): {f['etcd_restart_first_grant_s']}",
        f"all clients served again {f['settle_s']}s after the faults stopped; client errors: {f['client_errors']}",
    ]
    lines += [f"  VIOLATION {v}" for v in report.violations[:20]]
    return "\n".join(lines)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None
