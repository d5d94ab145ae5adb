"""``gpupool status``: leader, nodes, GPUs, jobs, queue and problems, read from etcd in one get.

Exit codes: 0 shown, 3 etcd unreachable (the message names the endpoint). Under ``-w`` an
unreachable etcd is shown and retried until Ctrl-C, as in ``gpupool top -w``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

import click
from rich.console import Console

from gpupool_sdk.cli.common import (
    endpoints_option,
    etcd_security_options,
    prefix_option,
    resolve_endpoints,
    watch_loop,
    watch_option,
)
from gpupool_sdk.cli.output import (
    READING_COLUMNS,
    TableSpec,
    emit_document,
    is_terminal,
    no_headers_option,
    output_option,
    print_sections,
    reading_cells,
)
from gpupool_sdk.coordinator.snapshot import PoolState, build_state
from gpupool_sdk.resources import GpuInfo, JobState, format_size
from gpupool_sdk.resources.gpu import device_readings
from gpupool_sdk.scheduler.types import JobView
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


def sharing_mechanism(gpu: GpuInfo, holders: Sequence[str], gated: Collection[str]) -> str:
    """How the GPU's jobs are kept apart: ``none``, ``mps``, ``timeslice`` or ``mig``.

    A MIG instance is ``mig`` while at most one job holds it (the hardware isolates it from the
    other instances). Shared by two or more jobs: ``mps`` when the agent runs an MPS control daemon
    for the GPU (the jobs run under the MPS limits of their grants), else ``timeslice`` when at
    least two of them run a time-slicing gate (the training runtime does, on shared slices of a
    GPU without MPS), else ``none`` (shares not enforced).

    Example:
        >>> from gpupool_sdk.inventory.simulated import parse_cluster_spec
        >>> g = parse_cluster_spec("n:1xA100-40GB:pcie")[0]
        >>> sharing_mechanism(g, ["a"], []), sharing_mechanism(g, ["a", "b"], ["a", "b"]), sharing_mechanism(g, ["a", "b"], ["a"])
        ('none', 'timeslice', 'none')
    """
    if len(set(holders)) < 2:
        return "mig" if gpu.mig_profile else "none"
    if gpu.mps_pipe_dir:
        return "mps"
    if len(set(holders) & set(gated)) >= 2:
        return "timeslice"
    return "none"


def gang_members(view: JobView) -> list[dict[str, Any]]:
    """The members of a multi-node gang, one per node rank, with the slices each holds ([] for other jobs).

    A member is the process that leases one node's part (``jobs/{job}/members/{node}``); the
    list shows the members the coordinator counts (a process that restarted after the grant
    counts again once the gang was granted anew). A node rank no member has joined yet is listed
    with ``joined: False`` and no node.
    """
    if not view.spec.is_gang:
        return []
    by_rank = {m.node_rank: m for m in view.members}
    out: list[dict[str, Any]] = []
    for rank in range(view.spec.nodes):
        m = by_rank.get(rank)
        if m is None:
            out.append({"node_rank": rank, "joined": False, "node": None, "hostname": None, "pid": None,
                        "joined_at": None, "acked_seq": 0, "slices": []})
            continue
        slices = [
            {"gpu_uuid": a.gpu_uuid, "gpu_index": a.gpu_index, "memory_bytes": a.memory_bytes,
             "compute_share": a.compute_share}
            for a in sorted(view.allocations, key=lambda a: (a.gpu_index, a.gpu_uuid))
            if a.node == m.node
        ]
        out.append({"node_rank": rank, "joined": True, "node": m.node, "hostname": m.hostname or None,
                    "pid": m.pid or None, "joined_at": m.joined_at or None, "acked_seq": m.acked_seq, "slices": slices})
    return out


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
                "mig_profile": g.mig_profile,
                "mig_parent": g.mig_parent,
                "sharing": sharing_mechanism(g, holders.get(g.uuid, []), state.timeslice_members.get(g.uuid, ())),
                # the agent's last published readings: temperature and power from the GPU record,
                # usage from readings/{node}/{gpu} (up to its --usage-interval old)
                "readings": device_readings(g.health, state.readings.get(g.uuid)),
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
                "resizes": st.resizes if st else 0,
                "resize_retry_at": st.resize_retry_at if st else None,
                "allocations": [
                    {"node": a.node, "gpu_uuid": a.gpu_uuid, "gpu_index": a.gpu_index, "memory_bytes": a.memory_bytes,
                     "compute_share": a.compute_share}
                    for a in v.allocations
                ],
                "directive": v.directive.to_dict() if v.directive else None,
                "nodes": v.spec.nodes,
                "members": gang_members(v),
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
        # Jobs that left: how they ended (a FAILED run under `gpupool run`, kept for its retention).
        "results": [r.to_dict() for r in sorted(state.results.values(), key=lambda r: -r.finished_at)],
    }


def _slices(job: dict[str, Any]) -> str:
    """What a job asks for: ``2x20.0GiB``, ``1xwhole``; a gang ``2 nodes x 4x20.0GiB``."""
    mem = "whole" if job["memory_bytes"] == 0 else format_size(job["memory_bytes"])
    if job["nodes"] > 1:
        return f"{job['nodes']} nodes x {job['gpus'] // job['nodes']}x{mem}"
    return f"{job['gpus']}x{mem}"


def sections(state: PoolState, endpoint: str) -> list[TableSpec | str]:
    """The pool as lines and tables (columns named in ``wide`` appear under ``-o wide`` only)."""
    d = status_dict(state)
    now = state.snapshot.now
    parts: list[TableSpec | str] = []
    leader = d["leader"]
    if leader:
        head = f"leader {leader['id']} term {leader['term']} since {_ago(now, leader['since'])} ago"
    else:
        head = "leader none (no coordinator leads)"
    parts.append(f"{head}   etcd {endpoint} rev {d['revision']}")

    nodes = TableSpec(["NODE", "BACKEND", "GPUS", "HOST", "STATE"], [], "Nodes")
    for n in d["nodes"]:
        if n["draining"]:
            state_txt = "draining" + _why(d["intents"]["drains"].get(n["name"]))
        else:
            state_txt = "ready" if n["present"] else "no agent"
        nodes.rows.append([n["name"], n["backend"] or "-", str(n["gpus"]), n["hostname"] or "-", state_txt])
    parts.append(nodes if d["nodes"] else "no nodes: start `gpupool agent` on each GPU machine")

    gpus = TableSpec(
        ["NODE", "IDX", "UUID", "MODEL", "MEMORY", "USED", "JOBS", "SHARING", "HEALTH", "SCHED", *READING_COLUMNS,
         "ISLAND", "SIMULATED"],
        [], "GPUs",
        wide=frozenset({"ISLAND", "SIMULATED", *READING_COLUMNS[1:]}),
    )
    for g in d["gpus"]:
        health = "ok" if g["healthy"] else "UNHEALTHY: " + "; ".join(g["health_reasons"])
        if g["cordoned"]:
            sched = "cordoned" + _why(d["intents"]["cordons"].get(g["uuid"]))
        else:
            sched = "draining" + _why(d["intents"]["drains"].get(g["node"])) if g["draining"] else "-"
        gpus.rows.append([
            g["node"], str(g["index"]), g["uuid"], g["model"] + (f" MIG {g['mig_profile']}" if g["mig_profile"] else ""),
            format_size(g["memory_bytes"]), format_size(g["used_memory_bytes"]), ",".join(g["jobs"]) or "-", g["sharing"],
            health, sched, *reading_cells(g["readings"]),
            "-" if g["nvlink_island"] is None else str(g["nvlink_island"]), "yes" if g["simulated"] else "no",
        ])
    if d["gpus"]:
        parts.append(gpus)

    jobs = TableSpec(
        ["JOB", "STATE", "PRIO", "QOS", "SLICES", "ALLOCATIONS", "OWNER", "LEASE", "TERM", "PREEMPTIONS", "RESIZES",
         "REASON"], [],
        "Jobs", wide=frozenset({"OWNER", "LEASE", "TERM", "PREEMPTIONS", "RESIZES"}),
    )
    for j in d["jobs"]:
        allocs = " ".join(f"{a['node']}/{a['gpu_index']}" for a in j["allocations"]) or "-"
        jobs.rows.append([
            j["name"], j["state"], str(j["priority"]), j["qos"], _slices(j), allocs, j["owner"] or "-",
            j["lease"], str(j["term"]), str(j["preemptions"]), str(j["resizes"]), j["reason"],
        ])
    parts.append(jobs if d["jobs"] else "no jobs")

    gangs = [j for j in d["jobs"] if j["members"]]
    if gangs:
        g = TableSpec(["JOB", "RANK", "MEMBER", "NODE", "SLICES", "HOST", "PID", "ACKED SEQ"], [], "Gang members",
                      wide=frozenset({"HOST", "PID", "ACKED SEQ"}))
        for j in gangs:
            for m in j["members"]:
                rank = f"{m['node_rank']}/{j['nodes']}"
                if not m["joined"]:
                    g.rows.append([j["name"], rank, "missing", "-", "-", "-", "-", "-"])
                    continue
                slices = " ".join(f"{m['node']}/{s['gpu_index']}" for s in m["slices"]) or "-"
                g.rows.append([j["name"], rank, "joined", m["node"], slices, m["hostname"] or "-", str(m["pid"] or "-"),
                               str(m["acked_seq"])])
        parts.append(g)

    if d["queue"]:
        q = TableSpec(["#", "JOB", "PRIO", "WAITING", "REASON"], [], "Queue")
        for i, j in enumerate(d["queue"], 1):
            q.rows.append([str(i), j["name"], str(j["priority"]), f"{j['waiting_s']:.0f}s", j["reason"]])
        parts.append(q)
    if d["orphan_allocations"]:
        parts.append(f"{len(d['orphan_allocations'])} allocation(s) of jobs with no spec (their lease is expiring)")
    if d["problems"]:
        p = TableSpec(["KEY", "PROBLEM"], [[pr["key"], pr["message"]] for pr in d["problems"]], "Problems (skipped)")
        parts.append(p)
    return parts


@click.command("status")
@endpoints_option
@etcd_security_options
@prefix_option
@output_option
@no_headers_option
@watch_option
def status(
    endpoints: str | None,
    security: EtcdSecurity,
    prefix: str | None,
    output: str,
    no_headers: bool,
    watch_s: float | None,
) -> None:
    """Show the leader, nodes, GPUs, jobs, the queue and any malformed keys.

    On a terminal the tables have borders; piped or redirected they are plain aligned columns.

    \b
    Examples:
        gpupool status                 # tables
        gpupool status -o wide         # more columns (owner, lease, term, NVLink island...)
        gpupool status -o json         # the same as JSON (or -o yaml), for scripts
        gpupool status -w 2 -o json    # one JSON object per line every 2 s until Ctrl-C

    \b
    Exit codes: 0 shown, 2 bad usage, 3 etcd unreachable (one-shot; under -w it is retried).
    """
    # Malformed keys are shown in the "problems" section; the snapshot's log line would repeat them.
    logging.getLogger("gpupool_sdk.coordinator.snapshot").setLevel(logging.ERROR)
    store = open_store(endpoints, prefix, security=security)
    console = Console() if is_terminal() else None
    watched = [0]

    def show(state: PoolState, watching: bool) -> None:
        if output in ("json", "yaml"):
            emit_document(status_dict(state), output, watching)
            return
        if watching and console is not None:
            console.clear()
        elif watched[0]:
            click.echo("")
        watched[0] += 1
        print_sections(sections(state, store.endpoint), wide=output == "wide", no_headers=no_headers, console=console)

    try:
        watch_loop(endpoints, watch_s, lambda: read_pool(store), show)
    finally:
        store.close()
