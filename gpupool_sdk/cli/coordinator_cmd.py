"""``gpupool coordinator``: run one coordinator replica (run two or more; one leads).

SIGTERM or SIGINT resigns leadership at once (the leader key is deleted under the fence and the
lease revoked), so a standby takes over without waiting for the TTL. SIGKILL leaves the key to
expire with the lease: a standby takes over within one TTL.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
from dataclasses import replace
from types import FrameType

import click

from gpupool_sdk.cli.common import (
    endpoints_option,
    etcd_security_options,
    prefix_option,
    resolve_endpoints,
    wait_for_etcd,
)
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator import Coordinator
from gpupool_sdk.coordinator.coordinator import DEFAULT_ETCD_MAX_TXN_OPS
from gpupool_sdk.errors import ConfigError, StoreUnavailableError
from gpupool_sdk.scheduler.autoscale import AutoscaleSettings
from gpupool_sdk.scheduler.config import load_policy_config, parse_assignment
from gpupool_sdk.scheduler.types import MIN_ETCD_MAX_TXN_OPS
from gpupool_sdk.store import EtcdSecurity, EtcdStore
from gpupool_sdk.store.keyspace import Keyspace

#: Deadline of the metrics endpoint's etcd read (its scrape answers within it, etcd up or not).
METRICS_READ_TIMEOUT_S = 2.0


def default_retry_timeout(ttl_s: float, loop_wait_s: float) -> float:
    """Patroni's default of 10 s, capped so that ``loop_wait + 2 * retry_timeout <= ttl`` holds."""
    if not (math.isfinite(ttl_s) and math.isfinite(loop_wait_s)):
        return 10.0  # the timing check that follows rejects the non-finite flag, naming it
    return max(0.1, min(10.0, (math.ceil(ttl_s) - loop_wait_s) / 2))


#: ``AutoscaleSettings`` field -> the flag that sets it (for error messages).
AUTOSCALE_FLAGS = {
    "scale_up_after_s": "--scale-up-after",
    "scale_down_idle_s": "--scale-down-idle",
    "min_nodes": "--autoscale-min-nodes",
    "max_nodes": "--autoscale-max-nodes",
    "gpus_per_node": "--autoscale-gpus-per-node",
    "default_type": "--autoscale-default-type",
}


def autoscale_settings(
    enabled: bool = True,
    scale_up_after_s: float | None = None,
    scale_down_idle_s: float | None = None,
    min_nodes: int | None = None,
    max_nodes: int | None = None,
    gpus_per_node: tuple[str, ...] = (),
    default_type: str | None = None,
) -> AutoscaleSettings | None:
    """The coordinator's :class:`AutoscaleSettings` from its flags (None: ``--no-autoscale``).

    Unset flags keep the settings' defaults.

    Raises:
        click.BadParameter: a value out of range or a malformed ``TYPE=N``, naming the flag.

    Example:
        >>> autoscale_settings(gpus_per_node=("H100-80GB=8",), max_nodes=32).max_nodes
        32
    """
    given = {"scale_up_after_s": scale_up_after_s, "scale_down_idle_s": scale_down_idle_s, "min_nodes": min_nodes,
             "max_nodes": max_nodes, "default_type": default_type}
    if not enabled:
        set_flags = [AUTOSCALE_FLAGS[k] for k, v in given.items() if v is not None] + (
            [AUTOSCALE_FLAGS["gpus_per_node"]] if gpus_per_node else [])
        if set_flags:
            raise click.BadParameter(f"{', '.join(set_flags)} given with --no-autoscale; drop one or the other",
                                     param_hint="--no-autoscale")
        return None
    per_node: dict[str, int] = {}
    for text in gpus_per_node:
        gpu_type, sep, count = text.partition("=")
        gpu_type, count = gpu_type.strip(), count.strip()
        if not sep or not gpu_type or not count.isdigit() or int(count) < 1:
            raise click.BadParameter(f"{text!r}: expected TYPE=N with a whole N >= 1, e.g. H100-80GB=8",
                                     param_hint="--autoscale-gpus-per-node")
        per_node[gpu_type] = int(count)
    if default_type is not None and not default_type.strip():
        raise click.BadParameter("must name a GPU type, e.g. H100-80GB", param_hint="--autoscale-default-type")
    values: dict[str, object] = {k: v for k, v in given.items() if v is not None}
    try:
        return AutoscaleSettings(**values, gpus_per_node=per_node)  # type: ignore[arg-type]
    except ConfigError as exc:
        flag = AUTOSCALE_FLAGS.get(exc.field, exc.field)
        if exc.field == "min_nodes" and min_nodes is None:
            flag = "--autoscale-max-nodes"
        message = str(exc)[len(exc.field) + 2:] if str(exc).startswith(exc.field + ": ") else str(exc)
        raise click.BadParameter(message, param_hint=flag) from None


def describe_autoscale(settings: AutoscaleSettings | None) -> str:
    """One line for the start-up banner: the autoscale thresholds in force, or ``off``."""
    if settings is None:
        return "# autoscale: off (--no-autoscale)"
    per = ", ".join(f"{t}={n}" for t, n in sorted(settings.gpus_per_node.items())) or "largest node of the type"
    return (f"# autoscale: scale_up_after {settings.scale_up_after_s:g}s, scale_down_idle {settings.scale_down_idle_s:g}s, "
            f"nodes {settings.min_nodes}-{settings.max_nodes} per type, gpus_per_node {per}, "
            f"default_type {settings.default_type or 'most nodes'}")


@click.command("coordinator")
@endpoints_option
@etcd_security_options
@prefix_option
@click.option("--id", "coordinator_id", default=None, help="Replica id (default <hostname>-<pid>).")
@click.option("--ttl", type=float, default=30.0, show_default=True, help="Leader lease TTL in seconds.")
@click.option("--loop-wait", type=float, default=10.0, show_default=True,
              help="Seconds between time-driven cycles and renewals (changes wake it at once).")
@click.option("--retry-timeout", type=float, default=None,
              help="Seconds one etcd renewal may retry (default: min(10, (ttl - loop_wait) / 2)).")
@click.option("--config", "config_path", default=None, metavar="FILE.toml",
              help="Policy file ([scheduler] settings, [prices]; docs/scheduler.md 'Policy file'), the same one "
                   "`gpupool simulate --config` reads. Default: the built-in defaults. Flags below override it.")
@click.option("--set", "assignments", multiple=True, metavar="FIELD=VALUE",
              help="Set one scheduler field, TOML value (min_runtime_s=600, use_remaining=false); repeatable.")
@click.option("--overcommit-ratio", type=float, default=None,
              help="For shared slices: granted memory may reach this multiple of a GPU's memory (default 1.5).")
@click.option("--min-runtime", type=float, default=None,
              help="Seconds after a grant before a job may be preempted (default 0).")
@click.option("--aging", type=float, default=None,
              help="A pending job gains one priority point per this many seconds waited (default 0 = off).")
@click.option("--preempt-grace", type=float, default=None,
              help="Default seconds a job gets to checkpoint and ack a preemption (default 60).")
@click.option("--no-preemption", is_flag=True, help="Never preempt: jobs only queue.")
@click.option("--etcd-max-txn-ops", type=click.IntRange(MIN_ETCD_MAX_TXN_OPS, None), default=None,
              help="Must match etcd's --max-txn-ops (`gpupool etcd` uses 1024). A gang's grant and release are one "
                   f"transaction each, with an operation per slice: jobs that would need more than this are rejected "
                   f"(default: the policy file's etcd_max_txn_ops, else {DEFAULT_ETCD_MAX_TXN_OPS}, etcd's default).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics (pool and scheduler) on this port.")
@click.option("--metrics-addr", default="0.0.0.0", show_default=True, envvar="GPUPOOL_METRICS_ADDR", show_envvar=True,
              help="Address the metrics port binds (127.0.0.1: this machine only).")
@click.option("--orphan-grace", "orphan_grace_s", type=float, default=None,
              help="Seconds before the leader deletes an orphaned allocation (its job's lease or spec gone); "
                   "counted as used until then. Default 2 x --ttl.")
@click.option("--autoscale/--no-autoscale", "autoscale_on", default=True, show_default=True,
              help="Publish the autoscale signal ({prefix}/autoscale and gpupool_autoscale_* metrics; docs/autoscale.md).")
@click.option("--scale-up-after", "scale_up_after_s", type=float, default=None, metavar="SECONDS",
              help="Autoscale: a pending job counts as demand for new nodes once it has waited this long (default 60).")
@click.option("--scale-down-idle", "scale_down_idle_s", type=float, default=None, metavar="SECONDS",
              help="Autoscale: a node holding no slice this long is named for scale-down (default 600).")
@click.option("--autoscale-min-nodes", type=int, default=None, metavar="N",
              help="Autoscale: never ask for fewer nodes of a GPU type than this (default 0).")
@click.option("--autoscale-max-nodes", type=int, default=None, metavar="N",
              help="Autoscale: never ask for more nodes of a GPU type than this (default 10000).")
@click.option("--autoscale-gpus-per-node", "autoscale_gpus_per_node", multiple=True, metavar="TYPE=N",
              help="Autoscale: GPUs a new node of TYPE brings (H100-80GB=8); repeatable. Default: the largest node "
                   "of that type in the pool, else 8.")
@click.option("--autoscale-default-type", default=None, metavar="TYPE",
              help="Autoscale: the GPU type pending jobs without gpu_model count for (default: the type with the most "
                   "nodes).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
def coordinator(
    endpoints: str | None,
    security: EtcdSecurity,
    prefix: str | None,
    coordinator_id: str | None,
    ttl: float,
    loop_wait: float,
    retry_timeout: float | None,
    config_path: str | None,
    assignments: tuple[str, ...],
    overcommit_ratio: float | None,
    min_runtime: float | None,
    aging: float | None,
    preempt_grace: float | None,
    no_preemption: bool,
    etcd_max_txn_ops: int | None,
    metrics_port: int | None,
    metrics_addr: str,
    orphan_grace_s: float | None,
    autoscale_on: bool,
    scale_up_after_s: float | None,
    scale_down_idle_s: float | None,
    autoscale_min_nodes: int | None,
    autoscale_max_nodes: int | None,
    autoscale_gpus_per_node: tuple[str, ...],
    autoscale_default_type: str | None,
    log_level: str,
) -> None:
    """Run a coordinator replica: leader election, scheduling, fenced grants and preemptions."""
    # A command line owns its process: configuring logging here is the host's choice, not the library's.
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if retry_timeout is None:
        retry_timeout = default_retry_timeout(ttl, loop_wait)
    overrides: dict[str, object] = {}
    flags: dict[str, str] = {}
    try:
        for text in assignments:
            key, value = parse_assignment(text)
            overrides[key], flags[key] = value, f"--set {key}"
        for key, flag, value in (
            ("overcommit_ratio", "--overcommit-ratio", overcommit_ratio),
            ("min_runtime_s", "--min-runtime", min_runtime),
            ("aging_s_per_priority", "--aging", aging),
            ("preempt_grace_s", "--preempt-grace", preempt_grace),
            ("allow_preemption", "--no-preemption", False if no_preemption else None),
            ("etcd_max_txn_ops", "--etcd-max-txn-ops", etcd_max_txn_ops),
        ):
            if value is not None:
                overrides[key], flags[key] = value, flag
        timing = LeaseTiming(ttl_s=ttl, keepalive_interval_s=min(loop_wait, max(0.1, ttl / 3)), retry_timeout_s=retry_timeout)
        # One policy for the coordinator and `gpupool simulate`: defaults, then --config, then flags.
        policy = load_policy_config(config_path, overrides, flags)
        config = policy.scheduler
        if config.etcd_max_txn_ops == 0:
            config = replace(config, etcd_max_txn_ops=DEFAULT_ETCD_MAX_TXN_OPS)  # etcd always has a limit
            policy = replace(policy, scheduler=config)
        etcd_max_txn_ops = config.etcd_max_txn_ops
        prices = policy.price_table()
    except ConfigError as exc:
        flag = {"ttl_s": "--ttl", "retry_timeout_s": "--retry-timeout", "keepalive_interval_s": "--loop-wait"}.get(
            exc.field, exc.field
        )
        message = str(exc)[len(exc.field) + 2 :] if flag == exc.field else str(exc)
        raise click.BadParameter(message, param_hint=flag) from None
    autoscale = autoscale_settings(
        autoscale_on, scale_up_after_s, scale_down_idle_s, autoscale_min_nodes, autoscale_max_nodes,
        autoscale_gpus_per_node, autoscale_default_type,
    )
    store = EtcdStore(
        resolve_endpoints(endpoints), keyspace=Keyspace.from_env(prefix), timeout_s=max(1.0, retry_timeout), security=security
    )
    coord_metrics = None
    if metrics_port is not None:
        from gpupool_sdk.telemetry.coordinator_metrics import CoordinatorMetrics

        coord_metrics = CoordinatorMetrics()
    try:
        coord = Coordinator(
            store, config, timing, coordinator_id=coordinator_id, loop_wait_s=loop_wait, prices=prices,
            on_cycle=coord_metrics.observe_cycle if coord_metrics is not None else None,
            orphan_grace_s=orphan_grace_s, autoscale=autoscale,
        )
    except ConfigError as exc:
        hint = "--orphan-grace" if exc.field == "orphan_grace_s" else "--loop-wait"
        raise click.BadParameter(str(exc), param_hint=hint) from None
    try:
        # A wrong --endpoints exits 3 (naming the endpoint) after one TTL of retries, as `gpupool
        # agent` does: a replica started beside etcd waits for it; once running it rides out outages.
        wait_for_etcd("coordinator", endpoints, store.revision, timing.ttl_s)
    except StoreUnavailableError:
        store.close()
        raise

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        coord.stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    metrics = None
    if metrics_port is not None and coord_metrics is not None:
        from gpupool_sdk.telemetry.prometheus import serve_metrics

        coord_metrics.watch(coord)
        # A connection of its own with a short deadline: with etcd down a scrape answers
        # gpupool_store_up 0 within METRICS_READ_TIMEOUT_S, inside Prometheus's scrape timeout,
        # instead of retrying for as long as the coordinator's own calls do.
        metrics_store = EtcdStore(
            resolve_endpoints(endpoints), keyspace=store.keys, timeout_s=METRICS_READ_TIMEOUT_S, security=security
        )
        try:
            metrics = serve_metrics(metrics_store, metrics_port, metrics_addr, extra_collectors=[coord_metrics])
        except ConfigError as exc:
            metrics_store.close()
            store.close()
            raise click.BadParameter(str(exc), param_hint="--metrics-port/--metrics-addr") from None
        click.echo(f"metrics on http://{metrics_addr}:{metrics.port}/metrics", err=True)
    click.echo(
        f"coordinator {coord.id} on {store.endpoint} prefix {store.keys.prefix} "
        f"(ttl {timing.ttl_s:g}s, loop_wait {coord.timing.loop_wait_s:g}s, retry_timeout {timing.retry_timeout_s:g}s, "
        f"etcd_max_txn_ops {etcd_max_txn_ops})",
        err=True,
    )
    click.echo(policy.describe(), err=True)
    click.echo(describe_autoscale(autoscale), err=True)
    try:
        stats = coord.run()
    finally:
        if metrics is not None:
            metrics.close()
            metrics_store.close()
        store.close()
    click.echo(f"coordinator {coord.id} stopped after {stats.cycles} cycle(s)", err=True)
    sys.exit(0)
