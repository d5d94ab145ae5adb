"""``gpupool job list|describe|cancel|forget``: one job at a time, in the manner of ``kubectl get/describe/delete``.

* ``list``: live jobs (``--all``: also finished ones that left usage or a checkpoint record).
* ``describe JOB``: spec, status and why, slices, a gang's members (node rank, node, slices),
  directive, last ack, telemetry, usage, the resume record and the job's etcd lease.
* ``cancel JOB``: revoke the job's etcd lease. Its spec, status, slices and directive vanish at
  once (the coordinator's next cycle gives the slices to others); the training process sees its
  lease lost, fences itself and exits (``gpupool run`` exits 75 so a scheduler may requeue).
* ``forget JOB``: delete what outlives a finished job (``usage/{job}``, ``checkpoints/{job}``):
  a later job of the same name starts afresh (no resume, no aging credit). Refused for a live job.

Exit codes: 0 done, 1 refused (``forget`` of a live job), 2 bad usage, 3 etcd unreachable,
4 no such job.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import click
from rich.console import Console

from gpupool_sdk.cli.common import (
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    endpoints_option,
    etcd_security_options,
    prefix_option,
    unreachable,
    watch_loop,
    watch_option,
)
from gpupool_sdk.cli.output import (
    TableSpec,
    emit_document,
    is_terminal,
    no_headers_option,
    output_option,
    print_sections,
)
from gpupool_sdk.cli.status_cmd import open_store, read_pool, status_dict
from gpupool_sdk.coordinator.snapshot import PoolState
from gpupool_sdk.errors import StoreUnavailableError
from gpupool_sdk.resources import format_size
from gpupool_sdk.store import EtcdSecurity, EtcdStore

FINISHED = "FINISHED"


def _clock(at: float) -> str:
    """``at`` (seconds since the epoch) as a UTC time of day with its date."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def _age(now: float, since: float | None) -> str:
    if not since:
        return "-"
    s = max(0.0, now - since)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def job_rows(state: PoolState, include_finished: bool = False) -> list[dict[str, Any]]:
    """One mapping per job: what ``gpupool job list -o json`` prints.

    Live jobs come from ``gpupool status``'s document; with ``include_finished``, jobs that left
    only a usage or checkpoint record are added with state ``FINISHED``.
    """
    rows: list[dict[str, Any]] = []
    for j in status_dict(state)["jobs"]:
        rows.append({
            "name": j["name"], "state": j["state"], "reason": j["reason"], "qos": j["qos"], "priority": j["priority"],
            "gpus": j["gpus"], "memory_bytes": j["memory_bytes"], "owner": j["owner"], "lease": j["lease"],
            "term": j["term"], "preemptions": j["preemptions"], "resizes": j["resizes"], "queued_at": j["queued_at"],
            "granted_at": j["granted_at"], "allocations": j["allocations"], "nodes": j["nodes"],
        })
    if include_finished:
        live = {r["name"] for r in rows}
        for name in sorted((set(state.usage) | set(state.resumes)) - live):
            usage = state.usage.get(name) or {}
            resume = state.resumes.get(name)
            rows.append({
                "name": name, "state": FINISHED, "reason": "no spec: the job ended; usage and checkpoint records remain",
                "qos": usage.get("qos", ""), "priority": None, "gpus": 0, "memory_bytes": 0,
                "owner": usage.get("owner", ""), "lease": None, "term": 0,
                "preemptions": resume.preemptions if resume is not None else 0,
                "resizes": resume.resizes if resume is not None else 0, "queued_at": None,
                "granted_at": None, "allocations": [], "nodes": None, "last_seen": usage.get("last_seen"),
            })
    return rows


def list_table(rows: list[dict[str, Any]], now: float) -> TableSpec:
    """The ``job list`` table (wide-only columns: MEMORY, LEASE, TERM, PREEMPTIONS, RESIZES, SLICES ON)."""
    t = TableSpec(
        ["JOB", "STATE", "QOS", "PRIO", "GPUS", "OWNER", "AGE", "MEMORY", "LEASE", "TERM", "PREEMPTIONS", "RESIZES",
         "SLICES ON", "REASON"],
        [], "Jobs", wide=frozenset({"MEMORY", "LEASE", "TERM", "PREEMPTIONS", "RESIZES", "SLICES ON"}),
    )
    for r in rows:
        since = r.get("granted_at") if r["state"] != "PENDING" else r.get("queued_at")
        mem = "-" if r["state"] == FINISHED else ("whole" if r["memory_bytes"] == 0 else format_size(r["memory_bytes"]))
        t.rows.append([
            r["name"], r["state"], r["qos"] or "-", "-" if r["priority"] is None else str(r["priority"]), str(r["gpus"]),
            r["owner"] or "-", _age(now, since or r.get("last_seen")), mem, r["lease"] or "-", str(r["term"]),
            str(r["preemptions"]), str(r.get("resizes", 0)), " ".join(f"{a['node']}/{a['gpu_index']}" for a in r["allocations"]) or "-",
            r["reason"],
        ])
    return t


def describe_doc(store: EtcdStore, state: PoolState, name: str) -> dict[str, Any] | None:
    """Everything the pool holds about job ``name``; None when it knows nothing of it."""
    meta = state.jobs.get(name)
    view = state.snapshot.jobs.get(name)
    usage = state.usage.get(name)
    resume = state.resumes.get(name)
    if meta is None and usage is None and resume is None:
        return None
    doc: dict[str, Any] = {"name": name, "state": FINISHED, "live": meta is not None}
    if meta is not None and view is not None:
        row = next(j for j in status_dict(state)["jobs"] if j["name"] == name)
        doc.update(state=row["state"], reason=row["reason"], spec=view.spec.to_dict(),
                   status=meta.status.to_dict() if meta.status else None, allocations=row["allocations"],
                   directive=row["directive"], members=row["members"], ack=view.ack.to_dict() if view.ack else None,
                   telemetry=dict(meta.telemetry) if meta.telemetry else None)
        info = store.lease_info(meta.lease) if meta.lease else None
        doc["lease"] = {
            "id": f"{meta.lease:x}",
            "ttl_remaining_s": info.ttl_remaining if info else None,
            "granted_ttl_s": info.granted_ttl if info else None,
            "keys": list(info.keys) if info else [],
        }
    doc["usage"] = dict(usage) if usage is not None else None
    doc["resume"] = resume.to_dict() if resume is not None else None
    return doc


def _describe_lines(doc: dict[str, Any]) -> list[str]:
    out = [f"Name:         {doc['name']}", f"State:        {doc['state']}"]
    if doc.get("reason"):
        out.append(f"Reason:       {doc['reason']}")
    spec = doc.get("spec")
    if spec:
        mem = spec.get("memory") or spec.get("memory_bytes") or 0
        out += [
            f"Owner:        {spec.get('owner') or '-'}",
            f"QoS:          {spec.get('qos')}   priority {spec.get('priority')}",
        ]
        nodes = spec.get("nodes") or 1
        if nodes > 1:
            out.append(f"Nodes:        {nodes} (a multi-node gang: each node's member leases that node's part)")
            wants = f"{spec.get('gpus')} GPU(s), {spec.get('gpus', 0) // nodes} per node"
        else:
            out.append(f"Node:         {spec.get('node') or 'any'}")
            wants = f"{spec.get('gpus')} GPU(s)"
        out.append(f"Wants:        {wants}" + (f", {format_size(mem)} each" if isinstance(mem, int) and mem else "")
                   + (f", model {spec['gpu_model']}" if spec.get("gpu_model") else ""))
    lease = doc.get("lease")
    if lease:
        ttl = lease["ttl_remaining_s"]
        out.append(f"Lease:        {lease['id']} (" + (f"{ttl}s of {lease['granted_ttl_s']}s left" if ttl is not None
                                                     else "expired") + ")")
    st = doc.get("status") or {}
    if st:
        out.append(f"Term:         {st.get('term', 0)}   preemptions {st.get('preemptions', 0)}   "
                   f"resizes {st.get('resizes', 0)}")
        if st.get("resize_retry_at"):
            out.append(f"Resize:       refused {st.get('resize_refusals', 0)} time(s) in a row; none proposed before "
                       f"{_clock(float(st['resize_retry_at']))}")
    allocs = doc.get("allocations") or []
    out.append("Slices:       " + (", ".join(
        f"{a['node']}/{a['gpu_index']} ({a['gpu_uuid']}, {format_size(a['memory_bytes'])}, share {a['compute_share']:g})"
        for a in allocs) or "none"))
    members = doc.get("members") or []
    for i, m in enumerate(members):
        label = "Members:      " if i == 0 else "              "
        if not m["joined"]:
            out.append(f"{label}node rank {m['node_rank']}: not joined")
            continue
        where = ", ".join(x for x in (m.get("hostname"), f"pid {m['pid']}" if m.get("pid") else None) if x)
        slices = ", ".join(f"{m['node']}/{x['gpu_index']}" for x in m["slices"]) or "no slices"
        out.append(f"{label}node rank {m['node_rank']}: {m['node']}" + (f" ({where})" if where else "")
                   + f": {slices}" + (f"; acked seq {m['acked_seq']}" if m.get("acked_seq") else ""))
    d = doc.get("directive")
    if d:
        out.append(f"Directive:    {d.get('kind')} seq {d.get('seq')}" + (f": {d['reason']}" if d.get("reason") else ""))
    ack = doc.get("ack")
    if ack:
        out.append(f"Last ack:     seq {ack.get('seq')} at step {ack.get('step')}"
                   + (f", checkpoint {ack['checkpoint']}" if ack.get("checkpoint") else ""))
    tel = doc.get("telemetry")
    if tel:
        body = tel.get("summary", tel)
        out.append(f"Telemetry:    step {body.get('step')}, {body.get('steps_per_s', 0):.2f} steps/s")
    usage = doc.get("usage")
    if usage:
        out.append(f"Usage:        {usage.get('gpu_seconds', 0) / 3600:.2f} GPU-h, ${usage.get('cost_usd', 0):.2f}")
    resume = doc.get("resume")
    if resume and resume.get("last_checkpoint"):
        out.append(f"Resume from:  {resume['last_checkpoint'].get('path')} (step {resume['last_checkpoint'].get('step')})")
    return out


def _read(store: EtcdStore, endpoints: str | None) -> PoolState:
    try:
        return read_pool(store)
    except StoreUnavailableError as exc:
        unreachable(endpoints, exc)


def _quiet_snapshot_log() -> None:
    # Malformed keys are not this command's business (gpupool status lists them).
    logging.getLogger("gpupool_sdk.coordinator.snapshot").setLevel(logging.ERROR)


@click.group("job")
def job() -> None:
    """List, describe, cancel or forget jobs."""


@job.command("list")
@endpoints_option
@etcd_security_options
@prefix_option
@output_option
@no_headers_option
@watch_option
@click.option("--all", "include_finished", is_flag=True, help="Also list finished jobs that left usage or checkpoints.")
@click.option("--state", "states", multiple=True, metavar="STATE",
              help="Only jobs in this state (PENDING, GRANTED, PREEMPTING, ..., FINISHED); repeatable.")
@click.option("--owner", default=None, help="Only jobs of this owner.")
def list_jobs(
    endpoints: str | None,
    security: EtcdSecurity,
    prefix: str | None,
    output: str,
    no_headers: bool,
    watch_s: float | None,
    include_finished: bool,
    states: tuple[str, ...],
    owner: str | None,
) -> None:
    """List jobs: state, class, size, owner, how long, and why.

    \b
    Examples:
        gpupool job list
        gpupool job list --state PENDING -o wide
        gpupool job list -o json | jq '.[] | select(.state == "PENDING") | .name'
        gpupool job list -w 5 -o json        # one JSON array per line every 5 s
    """
    _quiet_snapshot_log()
    wanted = {s.upper() for s in states}
    store = open_store(endpoints, prefix, security=security)
    console = Console() if is_terminal() else None
    printed = [0]

    def show(state: PoolState, watching: bool) -> None:
        rows = [
            r for r in job_rows(state, include_finished or FINISHED in wanted)
            if (not wanted or r["state"] in wanted) and (owner is None or r["owner"] == owner)
        ]
        if output in ("json", "yaml"):
            emit_document(rows, output, watching)
            return
        if watching and console is not None:
            console.clear()
        elif printed[0]:
            click.echo("")
        printed[0] += 1
        table = list_table(rows, state.snapshot.now)
        table.title = ""
        if rows:
            print_sections([table], wide=output == "wide", no_headers=no_headers, console=console)
        else:
            click.echo("no jobs", err=True)

    try:
        watch_loop(endpoints, watch_s, lambda: read_pool(store), show)
    finally:
        store.close()


@job.command("describe")
@click.argument("name")
@endpoints_option
@etcd_security_options
@prefix_option
@output_option
def describe(name: str, endpoints: str | None, security: EtcdSecurity, prefix: str | None, output: str) -> None:
    """Show everything the pool holds about job NAME (exit 4 when it knows nothing of it).

    \b
    Examples:
        gpupool job describe bert
        gpupool job describe bert -o yaml
    """
    _quiet_snapshot_log()
    store = open_store(endpoints, prefix, security=security)
    try:
        state = _read(store, endpoints)
        try:
            doc = describe_doc(store, state, name)
        except StoreUnavailableError as exc:
            unreachable(endpoints, exc)
    finally:
        store.close()
    if doc is None:
        # Keys of the job that the pool skips (a spec written by hand or by another release) are
        # why it "does not exist": name them, as `gpupool status` lists them under Problems.
        job_keys = f"{store.keys.jobs_prefix()}{name}/"
        skipped = [p for p in state.problems if p.key.startswith(job_keys)]
        if skipped:
            lines = "".join(f"\n  {p.key}: {p.message}" for p in skipped)
            click.echo(f"error: job {name!r} has keys the pool skips, so it is not scheduled:{lines}", err=True)
        else:
            click.echo(f"error: no job {name!r} in the pool (see `gpupool job list --all`)", err=True)
        sys.exit(EXIT_NOT_FOUND)
    if output in ("json", "yaml"):
        emit_document(doc, output)
    else:
        for line in _describe_lines(doc):
            click.echo(line)


@job.command("cancel")
@click.argument("name")
@endpoints_option
@etcd_security_options
@prefix_option
@output_option
def cancel(name: str, endpoints: str | None, security: EtcdSecurity, prefix: str | None, output: str) -> None:
    """Cancel job NAME: revoke its etcd lease, so its slices are freed at once.

    The training process sees its lease lost and stops using the GPUs (it does not get to
    checkpoint first: for a cooperative stop, send the process SIGTERM instead).

    \b
    Exit codes: 0 cancelled, 3 etcd unreachable, 4 no live job of that name.
    """
    _quiet_snapshot_log()
    store = open_store(endpoints, prefix, security=security)
    try:
        try:
            kv = store.get(store.keys.job_spec(name))
            if kv is None:
                click.echo(f"error: no live job {name!r} (see `gpupool job list`)", err=True)
                sys.exit(EXIT_NOT_FOUND)
            if kv.lease:
                store.revoke_lease(kv.lease)
                how = f"etcd lease {kv.lease:x} revoked"
            else:
                # A spec written without a lease (by hand): remove the job's keys instead.
                store.delete_prefix(store.keys.job_spec(name).rsplit("/", 1)[0] + "/")
                how = "its keys deleted (its spec had no lease)"
        except StoreUnavailableError as exc:
            unreachable(endpoints, exc)
    finally:
        store.close()
    obj = {"job": name, "cancelled": True, "lease": f"{kv.lease:x}" if kv.lease else None, "at": time.time()}
    if output in ("json", "yaml"):
        emit_document(obj, output)
    else:
        click.echo(f"job {name} cancelled: {how}; its slices are free for the next scheduling cycle")


@job.command("forget")
@click.argument("name")
@endpoints_option
@etcd_security_options
@prefix_option
@output_option
def forget(name: str, endpoints: str | None, security: EtcdSecurity, prefix: str | None, output: str) -> None:
    """Delete the records a finished job NAME left (usage, checkpoint): its name starts afresh.

    \b
    Exit codes: 0 forgotten, 1 the job is live (cancel it first), 3 etcd unreachable,
    4 nothing recorded under that name.
    """
    store = open_store(endpoints, prefix, security=security)
    keys = store.keys
    try:
        try:
            if store.get(keys.job_spec(name)) is not None:
                click.echo(f"error: job {name!r} is live; `gpupool job cancel {name}` first", err=True)
                sys.exit(EXIT_FAILED)
            deleted = [k for k in (keys.usage(name), keys.checkpoint(name)) if store.delete(k)]
            # Leftovers under jobs/{job}/ (a status or owner record without its spec).
            leftovers = store.delete_prefix(keys.job_spec(name).rsplit("/", 1)[0] + "/")
        except StoreUnavailableError as exc:
            unreachable(endpoints, exc)
    finally:
        store.close()
    if not deleted and not leftovers:
        click.echo(f"error: nothing recorded for job {name!r}", err=True)
        sys.exit(EXIT_NOT_FOUND)
    obj = {"job": name, "forgotten": True, "deleted": deleted, "leftovers_deleted": leftovers}
    if output in ("json", "yaml"):
        emit_document(obj, output)
    else:
        click.echo(f"job {name} forgotten: deleted {', '.join(deleted) or 'nothing'}"
                   + (f" and {leftovers} leftover key(s)" if leftovers else ""))
