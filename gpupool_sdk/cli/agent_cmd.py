"""``gpupool agent``: publish this machine's GPUs (or simulated ones) to the pool.

The agent writes ``agent-<pid>.json`` naming its node(s) into the runtime directory
(``$GPUPOOL_RUNTIME_DIR``, else ``/run/gpupool``, ``$XDG_RUNTIME_DIR/gpupool`` or
``/tmp/gpupool-$UID``; see :mod:`gpupool_sdk.client.node`) and removes it when it stops: training
processes on this machine lease this node's GPUs only. With several (simulated) nodes in one
agent, each process says which it is on with ``GPUPOOL_NODE``.

One process can publish several simulated nodes (``--simulate "a:4xH100,b:8xA100-40GB:pcie"``);
each node gets its own etcd lease, so the nodes appear and vanish independently, and a SIGTERM
revokes every lease: all the process's GPUs vanish at once. SIGKILL leaves them to expire with
the leases, one TTL later.
"""

from __future__ import annotations

import logging
import math
import re
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import click

from gpupool_sdk.agent.agent import DEFAULT_USAGE_INTERVAL_S, NodeAgent, run_agents
from gpupool_sdk.agent.signals import install_stop_handlers
from gpupool_sdk.cli.common import (
    endpoints_option,
    etcd_security_options,
    prefix_option,
    resolve_endpoints,
    wait_for_etcd,
)
from gpupool_sdk.client.node import remove_agent_file, write_agent_file
from gpupool_sdk.config import KEEPALIVE_ENV, LEASE_TTL_ENV, RETRY_TIMEOUT_ENV, LeaseTiming
from gpupool_sdk.errors import ConfigError, SpecError
from gpupool_sdk.inventory.base import InventoryBackend, simulated_backends
from gpupool_sdk.inventory.health import DEFAULT_MAX_TEMPERATURE_C, HealthThresholds
from gpupool_sdk.store import EtcdSecurity, EtcdStore
from gpupool_sdk.store.keyspace import Keyspace

DEFAULT_REFRESH_S = 5.0


def timing_for_ttl(ttl_s: float | None) -> LeaseTiming:
    """Lease timing of the agent: the environment's defaults, or derived from ``--ttl``.

    With a TTL, keepalives go every quarter TTL and one may retry for 3/8 of it, which meets
    ``keepalive_interval + 2 * retry_timeout <= ttl`` exactly.
    """
    if ttl_s is None:
        return LeaseTiming.from_env()
    return LeaseTiming(ttl_s=ttl_s, keepalive_interval_s=ttl_s / 4, retry_timeout_s=ttl_s * 3 / 8)


def _host_node_name() -> str:
    """The short host name, as a valid node name."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname().split(".")[0]).strip("-._")
    return name or "node"


def _usage_interval(text: str) -> float | None:
    """``--usage-interval``: seconds >= 0, or ``never`` (None)."""
    if text.strip().lower() == "never":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and math.isfinite(value)):
        raise click.BadParameter(f"must be a number of seconds >= 0 or 'never', got {text!r}", param_hint="--usage-interval")
    return value


def _backends(
    node: str | None, simulate: str | None, fault_file: str | None, thresholds: HealthThresholds
) -> list[InventoryBackend]:
    if simulate is not None:
        # A single unnamed node is this host; several unnamed ones are numbered after --node, else node-NN.
        try:
            return list(
                simulated_backends(
                    simulate,
                    default_node=node or _host_node_name(),
                    fault_file=fault_file,
                    thresholds=thresholds,
                    auto_base=node or "node",
                )
            )
        except SpecError as exc:
            hint = "--node" if exc.field == "node" else "--simulate"
            raise click.BadParameter(str(exc), param_hint=hint) from None
    if fault_file is not None:
        raise click.BadParameter("faults can only be injected into simulated GPUs; add --simulate SPEC", param_hint="--fault-file")
    from gpupool_sdk.inventory.nvml import NvmlBackend, NvmlUnavailableError

    try:
        return [NvmlBackend(node=node or _host_node_name(), thresholds=thresholds)]
    except NvmlUnavailableError as exc:
        raise click.UsageError(f"no GPU to publish: {exc}") from None


@click.command("agent")
@click.option("--node", default=None, help="Node name (default: the host name).")
@click.option(
    "--simulate",
    default=None,
    metavar="SPEC",
    help="Declare simulated GPUs instead of reading NVML: '4xH100-80GB:nvlink', "
    "'node-a:4xH100-80GB:nvlink,node-b:8xA100-40GB:pcie', '16*8xV100-32GB:nvlink=2x4' (see docs/inventory.md).",
)
@click.option(
    "--fault-file",
    type=click.Path(dir_okay=False),
    default=None,
    help='JSON {gpu_uuid: {"temperature_c": 95} | {"xid": 79} | {"ecc_double_bit": 2}} read on every refresh (simulated GPUs).',
)
@click.option("--refresh", "refresh_s", type=float, default=DEFAULT_REFRESH_S, show_default=True, help="Seconds between health refreshes.")
@click.option("--ttl", "ttl_s", type=float, default=None, help="Lease TTL in seconds (default $GPUPOOL_LEASE_TTL or 10).")
@click.option(
    "--usage-interval",
    "usage_interval",
    default=str(DEFAULT_USAGE_INTERVAL_S),
    show_default=True,
    metavar="SECONDS|never",
    help="Publish the GPUs' usage readings (utilisation, memory bandwidth, memory used, PCIe/NVLink) under "
    "readings/{node}/{gpu}, those that changed, at most this often; 0: on every refresh; never: not at all. "
    "They are not in the GPU records, so they never wake the coordinator. "
    "The --metrics-port series carry every refresh's readings.",
)
@click.option(
    "--max-temperature",
    "max_temperature_c",
    type=float,
    default=DEFAULT_MAX_TEMPERATURE_C,
    show_default=True,
    help="A GPU at or above this temperature (C) is unhealthy.",
)
@endpoints_option
@etcd_security_options
@prefix_option
@click.option(
    "--take-over",
    is_flag=True,
    default=False,
    help="Replace a live agent that publishes the same node name (it stops at its next refresh); "
    "without it, the agent refuses to start.",
)
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve the agent's per-GPU metrics (health, memory, temperature, ECC, XID, utilisation, "
              "PCIe/NVLink throughput) on this port.")
@click.option("--metrics-addr", default="0.0.0.0", show_default=True, envvar="GPUPOOL_METRICS_ADDR", show_envvar=True,
              help="Address the metrics port binds (127.0.0.1: this machine only).")
@click.option("--mps", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Run a CUDA MPS control daemon for the node's GPUs (auto: when nvidia-cuda-mps-control is "
              "installed and the GPUs are real), so jobs sharing a GPU get MPS compute and memory limits.")
@click.option("--mps-pipe-dir", default=None, help="Use an MPS daemon run by others: publish its pipe directory, start nothing.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
def agent(
    node: str | None,
    simulate: str | None,
    fault_file: str | None,
    refresh_s: float,
    ttl_s: float | None,
    usage_interval: str,
    max_temperature_c: float,
    endpoints: str | None,
    security: EtcdSecurity,
    prefix: str | None,
    take_over: bool,
    metrics_port: int | None,
    metrics_addr: str,
    mps: str,
    mps_pipe_dir: str | None,
    log_level: str,
) -> None:
    """Publish a node's GPUs under the agent's etcd lease and keep their health current.

    \b
    Examples:
      gpupool agent                                   # real GPUs, read through NVML
      gpupool agent --node node-a --simulate "4xH100-80GB:nvlink"
      gpupool agent --simulate "node-a:4xH100-80GB:nvlink,node-b:8xA100-40GB:pcie"
    """
    # A command line owns its process: configuring logging here is the host's choice, not the library's.
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        timing = timing_for_ttl(ttl_s)
    except ConfigError as exc:
        # Without --ttl the timing comes from the environment: name the variables, not only the flag.
        hint = "--ttl" if ttl_s is not None else f"${LEASE_TTL_ENV} / ${KEEPALIVE_ENV} / ${RETRY_TIMEOUT_ENV} (or pass --ttl)"
        raise click.BadParameter(str(exc), param_hint=hint) from None
    try:
        thresholds = HealthThresholds(max_temperature_c=max_temperature_c)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-temperature") from None
    if not refresh_s > 0:
        raise click.BadParameter(f"must be a positive number of seconds, got {refresh_s}", param_hint="--refresh")
    usage_interval_s = _usage_interval(usage_interval)

    backends = _backends(node, simulate, fault_file, thresholds)
    from gpupool_sdk.agent.mps import with_mps

    try:
        backends = [with_mps(b, mps, pipe_dir=mps_pipe_dir) for b in backends]
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--mps") from None
    store = EtcdStore(
        resolve_endpoints(endpoints),
        keyspace=Keyspace.from_env(prefix),
        timeout_s=max(0.5, min(5.0, timing.retry_timeout_s)),
        security=security,
    )
    stop = threading.Event()
    wake = threading.Event()
    restore = install_stop_handlers(stop, wake)

    node_file: list[Path] = []

    def started(agents: Sequence[NodeAgent]) -> None:
        # Node-local leasing: clients on this machine read which node(s) they run on from here.
        try:
            node_file.append(write_agent_file([a.node for a in agents], store.keys.prefix))
        except (OSError, ConfigError) as exc:
            click.echo(f"agent: could not write the node file ({exc}); clients here need GPUPOOL_NODE", err=True)
        click.echo(
            f"agent: {len(agents)} node(s) published ({', '.join(a.node for a in agents[:8])}"
            f"{', ...' if len(agents) > 8 else ''}) on {store.endpoint} prefix {store.keys.prefix}, "
            f"ttl {timing.ttl_s:g}s, refresh {refresh_s:g}s; SIGTERM revokes their leases",
            err=True,
        )

    metrics = None
    try:
        agents = [
            NodeAgent(store, b, timing, refresh_interval_s=refresh_s, wake=wake, take_over=take_over,
                      usage_interval_s=usage_interval_s)
            for b in backends
        ]
        if metrics_port is not None:
            from gpupool_sdk.telemetry.agent_metrics import serve_agent_metrics

            try:
                metrics = serve_agent_metrics(agents, metrics_port, metrics_addr)
            except ConfigError as exc:
                raise click.BadParameter(str(exc), param_hint="--metrics-port/--metrics-addr") from None
            click.echo(f"agent: metrics on http://{metrics_addr}:{metrics.port}/metrics", err=True)
        # Started beside etcd (or on a loaded machine): wait up to one TTL for it, then exit 3.
        wait_for_etcd("agent", endpoints, store.revision, timing.ttl_s)
        run_agents(agents, stop, wake=wake, on_started=started)
    finally:
        for f in node_file:
            remove_agent_file(f)
        if metrics is not None:
            metrics.close()
        restore()
        for b in backends:
            b.close()
        store.close()
    click.echo(f"agent: stopped; lease(s) of {len(backends)} node(s) revoked", err=True)
    sys.exit(0)
