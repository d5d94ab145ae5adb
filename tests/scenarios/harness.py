"""Scenario harness (fixtures in ``conftest.py``): real etcd, real ``gpupool coordinator`` processes, simulated GPUs, job clients.

* Coordinators are ``python -m gpupool_sdk.cli.main coordinator`` subprocesses (killed with real
  signals) with small timings: TTL 3 s, loop_wait 0.5 s.
* GPUs come from a real ``gpupool agent --simulate`` subprocess when the agent command exists,
  else they are published from the test under a lease of their own, exactly as the agent would.
* Jobs follow the lease protocol with direct store writes (:class:`Job`): spec created if absent
  under the job's own lease, ack of directives, release by revoking the lease.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from testkit import wait_for

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.errors import StoreError
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import (
    Ack,
    Allocation,
    Directive,
    JobSpec,
    JobState,
    JobStatus,
    LeaderRecord,
    NodeInfo,
)
from gpupool_sdk.store import EtcdStore, LeaseKeeper
from gpupool_sdk.store.codec import decode, decode_dict
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.records import ResumeRecord
from scenarios.invariants import check_invariants

COORD_TTL = 3
LOOP_WAIT = 0.5
# Leadership is trusted for ttl - retry_timeout = 2.25 s after a renewal: tolerant of a busy machine.
RETRY_TIMEOUT = 0.75
# Jobs' and the stand-in agent's leases: long enough that a starved test process (2 shared cores)
# does not lose them by accident; tests that need a lease to go revoke it.
JOB_TIMING = LeaseTiming(ttl_s=6, keepalive_interval_s=1.0, retry_timeout_s=2.0)
DEADLINE = 30.0  # generous bound for conditions that normally hold within a second

ROOT = Path(__file__).resolve().parents[2]


class Job:
    """A training job speaking the lease protocol through the store (a client stand-in)."""

    def __init__(self, pool: Pool, spec: JobSpec) -> None:
        self.pool = pool
        self.spec = spec
        self.name = spec.name
        self.lost = False
        self.acked_seq = 0
        self.keeper = LeaseKeeper(pool.store, JOB_TIMING, on_lost=self._on_lost)
        self.lease = self.keeper.start()
        created = pool.store.create(pool.keys.job_spec(spec.name), spec, lease=self.lease)
        assert created, f"job {spec.name} already exists"

    def _on_lost(self, reason: object) -> None:
        self.lost = True

    def status(self) -> JobStatus | None:
        got = self.pool.store.get_record(self.pool.keys.job_status(self.name), JobStatus)
        return got[0] if got else None

    def state(self) -> JobState | None:
        s = self.status()
        return s.state if s else None

    def wait_state(self, *states: JobState, timeout: float = DEADLINE) -> JobStatus:
        def check() -> JobStatus | None:
            s = self.status()
            return s if s is not None and s.state in states else None

        return wait_for(check, timeout, f"{self.name} to be {'/'.join(s.value for s in states)} (now {self.status()})")

    def allocations(self) -> list[Allocation]:
        return [a for a in self.pool.allocations() if a.job == self.name]

    def directive(self) -> Directive | None:
        got = self.pool.store.get_record(self.pool.keys.directive(self.name), Directive)
        return got[0] if got else None

    def wait_directive(self, timeout: float = DEADLINE) -> Directive:
        return wait_for(self.directive, timeout, f"a directive to {self.name}")

    def ack(self, directive: Directive, step: int = 100, checkpoint: str | None = None) -> None:
        ack = Ack(seq=directive.seq, step=step, checkpoint=checkpoint or f"/ckpt/{self.name}/step{step}.ckpt", at=time.time())
        self.pool.store.put(self.pool.keys.ack(self.name), ack, lease=self.lease)
        self.acked_seq = directive.seq

    def cooperate(self) -> bool:
        """Behave like a well-mannered client for one step: ack a new directive; on SUSPENDED, exit.

        Returns:
            False once the job has left (released after its preemption).
        """
        d = self.directive()
        if d is not None and d.seq > self.acked_seq:
            self.ack(d)
        if self.state() is JobState.SUSPENDED:
            self.release()
            return False
        return True

    def alive(self) -> bool:
        return self.pool.store.lease_info(self.lease) is not None

    def release(self) -> None:
        """Finish (or give up after a preemption): revoke the lease, every key of the job goes."""
        self.keeper.stop(revoke=True)


class Pool:
    """One scenario's pool: its own key prefix on the session etcd, its processes, its jobs."""

    def __init__(self, endpoint: str, keys: Keyspace, tmp_path: Path) -> None:
        self.endpoint = endpoint
        self.keys = keys
        self.tmp_path = tmp_path
        self.store = EtcdStore(endpoint, keyspace=keys)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.keepers: list[LeaseKeeper] = []
        self.jobs: list[Job] = []
        self._names: dict[int, str] = {}

    # processes --------------------------------------------------------------

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        p = subprocess.Popen(
            [sys.executable, "-m", "gpupool_sdk.cli.main", *args], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env
        )
        self.procs.append(p)
        return p

    def coordinator(self, cid: str, *extra: str) -> subprocess.Popen[bytes]:
        """Start a coordinator replica with the scenario timings (TTL 3 s, loop_wait 0.5 s)."""
        return self._spawn(
            f"coordinator-{cid}",
            ["coordinator", "--endpoints", self.endpoint, "--prefix", self.keys.prefix, "--id", cid,
             "--ttl", str(COORD_TTL), "--loop-wait", str(LOOP_WAIT), "--retry-timeout", str(RETRY_TIMEOUT),
             "--log-level", "info", *extra],
        )

    def log(self, name: str) -> str:
        path = self.tmp_path / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def has_agent(self) -> bool:
        """True when the real ``gpupool agent`` command exists (else GPUs are published by the test)."""
        return (
            importlib.util.find_spec("gpupool_sdk.cli.agent_cmd") is not None
            and os.environ.get("GPUPOOL_TEST_NO_AGENT") != "1"
        )

    def gpus(self, spec: str, agent: bool = True, fault_file: Path | None = None) -> list[str]:
        """Make GPUs appear as an agent with ``--simulate spec`` would; returns their UUIDs in order.

        With ``agent`` (and the agent command present) a real ``gpupool agent`` process publishes
        them (TTL 6 s, refresh 0.5 s, health faults read from ``fault_file``); otherwise the test
        publishes the same records under a lease of its own.
        """
        infos = parse_cluster_spec(spec)
        if agent and self.has_agent():
            extra = ["--fault-file", str(fault_file)] if fault_file is not None else []
            self._spawn(f"agent-{len(self.procs)}", ["agent", "--endpoints", self.endpoint, "--prefix", self.keys.prefix,
                                                      "--simulate", spec, "--ttl", "6", "--refresh", "0.5", *extra])
            want = {g.uuid for g in infos}
            wait_for(lambda: want <= set(self.gpu_uuids()), what=f"the agent to publish {spec}")
        else:
            keeper = LeaseKeeper(self.store, JOB_TIMING, on_lost=lambda e: None)
            lease = keeper.start()
            self.keepers.append(keeper)
            nodes: dict[str, int] = {}
            for g in infos:
                self.store.put(self.keys.gpu(g.node, g.uuid), g, lease=lease)
                nodes[g.node] = nodes.get(g.node, 0) + 1
            for node, n in nodes.items():
                info = NodeInfo(name=node, hostname="test", agent_pid=os.getpid(), gpu_count=n, backend="simulated",
                                started_at=time.time())
                self.store.put(self.keys.node(node), info, lease=lease)
        return [g.uuid for g in infos]

    # jobs -------------------------------------------------------------------

    def submit(self, name: str, **kw: Any) -> Job:
        job = Job(self, JobSpec(name=name, **kw))
        self.jobs.append(job)
        return job

    def client(self, spec: JobSpec, *extra: str) -> subprocess.Popen[bytes]:
        """Start a real job process (``client_proc.py``) that acquires ``spec`` through ``PoolClient``."""
        name = f"client-{spec.name}-{len(self.procs)}"
        log = open(self.tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("client_proc.py")), self.endpoint, self.keys.prefix,
             json.dumps(spec.to_dict()), *extra],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.procs.append(p)
        self._names[p.pid] = name
        return p

    def output(self, proc: subprocess.Popen[bytes]) -> str:
        return self.log(self._names[proc.pid])

    def wait_output(self, proc: subprocess.Popen[bytes], text: str, timeout: float = DEADLINE) -> str:
        return wait_for(lambda: text in self.output(proc) and self.output(proc), timeout, f"{text!r} from {self._names[proc.pid]}")

    # reads ------------------------------------------------------------------

    def gpu_uuids(self) -> list[str]:
        kvs, _ = self.store.get_prefix(self.keys.gpus_prefix())
        return [kv.key.rsplit("/", 1)[-1] for kv in kvs]

    def allocations(self) -> list[Allocation]:
        return [a for a, _ in self.store.list_records(self.keys.allocations_prefix(), Allocation)]

    def leader(self) -> LeaderRecord | None:
        got = self.store.get_record(self.keys.leader(), LeaderRecord)
        return got[0] if got else None

    def term_counter(self) -> int:
        kv = self.store.get(self.keys.term())
        return int(decode_dict(kv.key, kv.value)["term"]) if kv else 0

    def resume(self, job: str) -> ResumeRecord | None:
        kv = self.store.get(self.keys.checkpoint(job))
        return decode(kv.key, kv.value, ResumeRecord) if kv else None

    def wait_leader(self, timeout: float = DEADLINE) -> LeaderRecord:
        return wait_for(self.leader, timeout, "a coordinator to lead")

    def check(self, overcommit_ratio: float = 1.0) -> None:
        check_invariants(self.store, overcommit_ratio)

    # teardown ---------------------------------------------------------------

    def close(self) -> None:
        for job in self.jobs:
            with contextlib.suppress(StoreError):
                job.keeper.stop(revoke=True)
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for k in self.keepers:
            k.stop(revoke=True)
        try:
            self.store.delete_prefix(self.keys.root())
        finally:
            self.store.close()
