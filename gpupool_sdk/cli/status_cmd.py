"""``gpupool status``: leader, nodes, GPUs, jobs, queue and problems, read from etcd in one get.

Exit codes: 0 shown, 3 etcd unreachable (the message names the endpoint). Under ``-w`` an
unreachable etcd is shown and retried until Ctrl-C, as in ``gpupool top -w``.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import click
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from gpupool_sdk.cli.common import (
    echo_json,
    endpoints_option,
    etcd_security_options,
    output_option,
    prefix_option,
    resolve_endpoints,
    watch_loop,
    watch_option,
)
from gpupool_sdk.coordinator.snapshot import PoolState, build_state
from gpupool_sdk.resources import JobState, format_size
from gpupool_sdk.store import EtcdSecurity, EtcdStore
from gpupool_sdk.store.keyspace import Keyspace

# A status read should fail fast when etcd is down rather than retry for long.
STATUS_TIMEOUT_S = 3.0


def open_store(
    endpoints: str | None, prefix: str | None, timeout_s: float = STATUS_TIMEOUT_S, security: EtcdSecurity | None = None
) -> EtcdStore:
    """An :class:`EtcdStore` for a CLI command from its ``--endpoints`` / ``--prefix`` / ``--etcd-*`` options."""
    return EtcdStore(resolve_endpoints(endpoints), keyspace=Keyspace.from_env(prefix), timeout_s=timeout_s, security=security)


def read_pool(store: EtcdStore) -> PoolState:
    """The whole pool at one revision (malformed keys land in ``problems``)."""
    kvs, revision = store.get_prefix(store.keys.root())
    return build_state(kvs, store.keys, time.time(), revision)


def _ago(now: float, t: float | None) -> str:
    if not t:
        return "-"
    s = max(0.0, now - t)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


def _intent(body: Any) -> dict[str, Any]:
    return {k: body.get(k) for k in ("reason", "by", "at")} if isinstance(body, dict) else {}


def _why(body: Any) -> str:
    reason = body.get("reason") if isinstance(body, dict) else None
    return f" ({reason})" if reason else ""


def orphan_allocations(state: PoolState) -> list[dict[str, Any]]:
    """Allocations that belong to no live job (issue 12): counted as used until the leader deletes them.

    Each names the key and why it is an orphan (no lease, no live spec, an earlier incarnation's
    lease); the same keys are listed under ``problems`` with every key the coordinator ignores.
    """
    return [
        {"job": o.allocation.job, "node": o.allocation.node, "gpu_uuid": o.allocation.gpu_uuid,
         "memory_bytes": o.allocation.memory_bytes, "key": o.key, "lease": f"{o.lease:x}", "reason": o.reason}
        for o in state.orphans
        if o.allocation is not None
    ]


def status_dict(state: PoolState) -> dict[str, Any]:
    """The pool as a JSON-ready mapping (what ``-o json`` prints)."""
    snap = state.snapshot
    now = snap.now
    used: dict[str, int] = {}
    holders: dict[str, list[str]] = {}
    for a in state.allocations:
        used[a.gpu_uuid] = used.get(a.gpu_uuid, 0) + a.memory_bytes
        holders.setdefault(a.gpu_uuid, []).append(a.job)
    gpus = []
    for g in sorted(snap.gpus.values(), key=lambda g: (g.node, g.index, g.uuid)):
        gpus.append(
            {
                "uuid": g.uuid,
                "node": g.node,
                "index": g.index,
                "model": g.model,
                "memory_bytes": g.memory_bytes,
                "used_memory_bytes": used.get(g.uuid, 0),
                "jobs": sorted(holders.get(g.uuid, [])),
                "healthy": g.healthy,
                "health_reasons": list(g.health.reasons),
                "cordoned": g.uuid in snap.cordoned,
                "draining": g.node in snap.draining,
                "nvlink_island": g.nvlink_island,
                "simulated": g.simulated,
            }
        )
    node_names = sorted(set(state.nodes) | {g.node for g in snap.gpus.values()} | set(snap.draining))
    nodes = []
    for n in node_names:
        info = state.nodes.get(n)
        nodes.append(
            {
                "name": n,
                "present": info is not None,
                "backend": info.backend if info else None,
                "hostname": info.hostname if info else None,
                "gpus": sum(1 for g in snap.gpus.values() if g.node == n),
                "draining": n in snap.draining,
            }
        )
    jobs: list[dict[str, Any]] = []
    for name in sorted(snap.jobs):
        v = snap.jobs[name]
        meta = state.jobs[name]
        st = meta.status
        jobs.append(
            {
                "name": name,
                "state": v.state.value,
                "reason": st.reason if st else "waiting for the coordinator",
                "priority": v.spec.priority,
                "qos": v.spec.qos_class.value,
                "gpus": v.spec.gpus,
                "memory_bytes": v.spec.memory_bytes,
                "owner": v.spec.owner,
                "term": st.term if st else 0,
                "lease": f"{meta.lease:x}",
                "queued_at": v.queued_at,
                "granted_at": v.granted_at,
                "preemptions": st.preemptions if st else 0,
                "allocations": [
                    {"node": a.node, "gpu_uuid": a.gpu_uuid, "gpu_index": a.gpu_index, "memory_bytes": a.memory_bytes,
                     "compute_share": a.compute_share}
                    for a in v.allocations
                ],
                "directive": v.directive.to_dict() if v.directive else None,
            }
        )
    queue = [
        {"name": j["name"], "priority": j["priority"], "waiting_s": max(0.0, now - j["queued_at"]), "reason": j["reason"]}
        for j in sorted(
            (j for j in jobs if j["state"] == JobState.PENDING.value), key=lambda j: (-j["priority"], j["queued_at"])
        )
    ]
    orphans = orphan_allocations(state)
    return {
        "revision": state.revision,
        "leader": state.leader.to_dict() if state.leader else None,
        "nodes": nodes,
        "gpus": gpus,
        "jobs": jobs,
        "queue": queue,
        "orphan_allocations": orphans,
        "cordoned": sorted(snap.cordoned),
        "draining": sorted(snap.draining),
        "intents": {
            "cordons": {k: _intent(v) for k, v in sorted(state.cordons.items())},
            "drains": {k: _intent(v) for k, v in sorted(state.drains.items())},
        },
        "problems": [{"key": p.key, "message": p.message} for p in state.problems],
    }


def render(state: PoolState, endpoint: str) -> Group:
    """Rich tables for the pool."""
    d = status_dict(state)
    now = state.snapshot.now
    parts: list[Any] = []
    leader = d["leader"]
    if leader:
        head = Text.assemble(("leader ", "bold"), f"{leader['id']} term {leader['term']} since {_ago(now, leader['since'])} ago")
    else:
        head = Text.assemble(("leader ", "bold"), ("none", "yellow"), " (no coordinator leads)")
    parts.append(Text.assemble(head, f"   etcd {endpoint} rev {d['revision']}"))

    nodes = Table(title="Nodes", title_justify="left")
    for c in ("NODE", "BACKEND", "GPUS", "HOST", "STATE"):
        nodes.add_column(c)
    for n in d["nodes"]:
        if n["draining"]:
            state_txt = "draining" + _why(d["intents"]["drains"].get(n["name"]))
        else:
            state_txt = "ready" if n["present"] else "no agent"
        nodes.add_row(n["name"], n["backend"] or "-", str(n["gpus"]), n["hostname"] or "-", state_txt)
    parts.append(nodes if d["nodes"] else Text("no nodes: start `gpupool agent` on each GPU machine", "yellow"))

    gpus = Table(title="GPUs", title_justify="left")
    for c in ("NODE", "IDX", "UUID", "MODEL", "MEMORY", "USED", "JOBS", "HEALTH", "SCHED"):
        gpus.add_column(c)
    for g in d["gpus"]:
        health = "ok" if g["healthy"] else "UNHEALTHY: " + "; ".join(g["health_reasons"])
        if g["cordoned"]:
            sched = "cordoned" + _why(d["intents"]["cordons"].get(g["uuid"]))
        else:
            sched = "draining" + _why(d["intents"]["drains"].get(g["node"])) if g["draining"] else ""
        gpus.add_row(
            g["node"], str(g["index"]), g["uuid"], g["model"], format_size(g["memory_bytes"]),
            format_size(g["used_memory_bytes"]), ",".join(g["jobs"]) or "-", health, sched,
        )
    if d["gpus"]:
        parts.append(gpus)

    jobs = Table(title="Jobs", title_justify="left")
    # LEASE is hex, as etcdctl takes it: `etcdctl lease timetolive <LEASE> --keys` lists what the job holds.
    for c in ("JOB", "STATE", "PRIO", "QOS", "SLICES", "ALLOCATIONS", "LEASE", "REASON"):
        jobs.add_column(c)
    for j in d["jobs"]:
        mem = "whole" if j["memory_bytes"] == 0 else format_size(j["memory_bytes"])
        allocs = " ".join(f"{a['node']}/{a['gpu_index']}" for a in j["allocations"]) or "-"
        jobs.add_row(
            j["name"], j["state"], str(j["priority"]), j["qos"], f"{j['gpus']}x{mem}", allocs, j["lease"], j["reason"]
        )
    parts.append(jobs if d["jobs"] else Text("no jobs"))

    if d["queue"]:
        q = Table(title="Queue", title_justify="left")
        for c in ("#", "JOB", "PRIO", "WAITING", "REASON"):
            q.add_column(c)
        for i, j in enumerate(d["queue"], 1):
            q.add_row(str(i), j["name"], str(j["priority"]), f"{j['waiting_s']:.0f}s", j["reason"])
        parts.append(q)
    if d["orphan_allocations"]:
        parts.append(Text(f"{len(d['orphan_allocations'])} allocation(s) of jobs with no spec (their lease is expiring)", "yellow"))
    if d["problems"]:
        p = Table(title="Problems (skipped)", title_justify="left", style="red")
        p.add_column("KEY")
        p.add_column("PROBLEM")
        for pr in d["problems"]:
            p.add_row(pr["key"], pr["message"])
        parts.append(p)
    return Group(*parts)


@click.command("status")
@endpoints_option
@etcd_security_options
@prefix_option
@output_option
@watch_option
def status(endpoints: str | None, security: EtcdSecurity, prefix: str | None, output: str, watch_s: float | None) -> None:
    """Show the leader, nodes, GPUs, jobs, the queue and any malformed keys.

    \b
    Examples:
        gpupool status              # tables
        gpupool status -o json      # the same as JSON, for scripts
        gpupool status -w 2         # refresh every 2 s until Ctrl-C (an unreachable etcd is retried)
    """
    # Malformed keys are shown in the "problems" section; the snapshot's log line would repeat them.
    logging.getLogger("gpupool_sdk.coordinator.snapshot").setLevel(logging.ERROR)
    store = open_store(endpoints, prefix, security=security)
    # Piped output is not wrapped at 80 columns, so keys stay whole for grep and scripts.
    console = Console(width=None if sys.stdout.isatty() else 220)

    def show(state: PoolState, watching: bool) -> None:
        if output == "json":
            echo_json(status_dict(state))
        else:
            if watching:
                console.clear()
            console.print(render(state, store.endpoint))

    try:
        watch_loop(endpoints, watch_s, lambda: read_pool(store), show)
    finally:
        store.close()
