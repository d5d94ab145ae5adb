"""Operator intents: ``gpupool cordon|uncordon GPU_UUID`` and ``gpupool drain|undrain NODE``.

A cordon (``cordons/{gpu}``) stops new grants on a GPU; running jobs stay. A drain
(``drains/{node}``) also preempts the node's jobs, checkpoint first, so they run elsewhere.
Both keys have no lease: they survive agent and coordinator restarts until undone.

Exit codes: 0 done (or already so), 2 bad input, 3 etcd unreachable, 4 no such GPU/node
(``--force`` writes the intent anyway, e.g. before the agent starts).
"""

from __future__ import annotations

import getpass
import socket
import sys
import time
from typing import Any

import click

from gpupool_sdk.cli.common import (
    EXIT_NOT_FOUND,
    endpoints_option,
    etcd_security_options,
    prefix_option,
)
from gpupool_sdk.cli.output import emit_document, output_option
from gpupool_sdk.cli.status_cmd import open_store
from gpupool_sdk.resources import GpuInfo
from gpupool_sdk.store import EtcdSecurity, EtcdStore


def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in some containers; the host is enough
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _intent(target: str, reason: str) -> dict[str, Any]:
    return {"target": target, "reason": reason, "by": _who(), "at": time.time()}


def _find_gpu(store: EtcdStore, gpu_uuid: str) -> GpuInfo | None:
    for gpu, _kv in store.list_records(store.keys.gpus_prefix(), GpuInfo, on_error=lambda e: None):
        if gpu.uuid == gpu_uuid:
            return gpu
    return None


def _node_exists(store: EtcdStore, node: str) -> bool:
    if store.get(store.keys.node(node)) is not None:
        return True
    kvs, _ = store.get_prefix(store.keys.gpus_prefix(node))
    return bool(kvs)


def _report(output: str, obj: dict[str, Any], line: str) -> None:
    if output in ("json", "yaml"):
        emit_document(obj, output)
    else:
        click.echo(line)


def _not_found(output: str, what: str, obj: dict[str, Any]) -> None:
    msg = f"{what}; check `gpupool status`, or pass --force to record the intent anyway"
    if output in ("json", "yaml"):
        emit_document({**obj, "error": msg}, output)
    click.echo(f"error: {msg}", err=True)
    sys.exit(EXIT_NOT_FOUND)


_reason_option = click.option("--reason", default="", help="Why (shown in `gpupool status` and the jobs' status).")
_force_option = click.option("--force", is_flag=True, help="Write the intent even if no agent publishes it now.")


@click.command("cordon")
@click.argument("gpu_uuid")
@_reason_option
@_force_option
@endpoints_option
@etcd_security_options
@prefix_option
@output_option
def cordon(
    gpu_uuid: str, reason: str, force: bool, endpoints: str | None, security: EtcdSecurity, prefix: str | None, output: str
) -> None:
    """Stop new grants on GPU_UUID (its running jobs stay)."""
    with open_store(endpoints, prefix, security=security) as store:
        key = store.keys.cordon(gpu_uuid)
        obj: dict[str, Any] = {"gpu_uuid": gpu_uuid, "cordoned": True}
        if not force and _find_gpu(store, gpu_uuid) is None:
            _not_found(output, f"no GPU {gpu_uuid} is published under {store.keys.gpus_prefix()}", obj)
        created = store.create(key, _intent(gpu_uuid, reason))
        _report(output, {**obj, "changed": created}, f"GPU {gpu_uuid} {'cordoned' if created else 'was already cordoned'}")


@click.command("uncordon")
@click.argument("gpu_uuid")
@endpoints_option
@etcd_security_options
@prefix_option
@output_option
def uncordon(
    gpu_uuid: str, endpoints: str | None, security: EtcdSecurity, prefix: str | None, output: str
) -> None:
    """Allow new grants on GPU_UUID again."""
    with open_store(endpoints, prefix, security=security) as store:
        deleted = store.delete(store.keys.cordon(gpu_uuid))
        _report(
            output,
            {"gpu_uuid": gpu_uuid, "cordoned": False, "changed": deleted},
            f"GPU {gpu_uuid} {'uncordoned' if deleted else 'was not cordoned'}",
        )


@click.command("drain")
@click.argument("node")
@_reason_option
@_force_option
@endpoints_option
@etcd_security_options
@prefix_option
@output_option
def drain(
    node: str, reason: str, force: bool, endpoints: str | None, security: EtcdSecurity, prefix: str | None, output: str
) -> None:
    """Drain NODE: no new grants; its jobs are preempted (checkpoint first) and placed elsewhere."""
    with open_store(endpoints, prefix, security=security) as store:
        key = store.keys.drain(node)
        obj: dict[str, Any] = {"node": node, "draining": True}
        if not force and not _node_exists(store, node):
            _not_found(output, f"no node {node} is published under {store.keys.nodes_prefix()}", obj)
        created = store.create(key, _intent(node, reason))
        _report(output, {**obj, "changed": created}, f"node {node} {'draining' if created else 'was already draining'}")


@click.command("undrain")
@click.argument("node")
@endpoints_option
@etcd_security_options
@prefix_option
@output_option
def undrain(
    node: str, endpoints: str | None, security: EtcdSecurity, prefix: str | None, output: str
) -> None:
    """Stop draining NODE: it takes new grants again."""
    with open_store(endpoints, prefix, security=security) as store:
        deleted = store.delete(store.keys.drain(node))
        _report(
            output,
            {"node": node, "draining": False, "changed": deleted},
            f"node {node} {'undrained' if deleted else 'was not draining'}",
        )
