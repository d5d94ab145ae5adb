"""``gpupool etcd``: run a real etcd on loopback in the foreground (one member, or ``--members 3``)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import FrameType

import click

from gpupool_sdk.cli.common import ENDPOINTS_ENV
from gpupool_sdk.errors import ConfigError
from gpupool_sdk.store.launcher import LAUNCHER_MAX_TXN_OPS, EtcdCluster, EtcdServer, EtcdServerTLS
from gpupool_sdk.store.security import CACERT_ENV


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "gpupool" / "etcd"


@click.command("etcd")
@click.option("--port", type=click.IntRange(1, 65535), default=2379, show_default=True, help="Client port.")
@click.option("--peer-port", type=click.IntRange(1, 65535), default=None, help="Peer port (default: --port + 1).")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Data directory (default: $XDG_DATA_HOME/gpupool/etcd, kept across restarts).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Listen address.")
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds to wait for etcd to be healthy.")
@click.option("--cert-file", metavar="PATH", default=None,
              help="Serve clients over TLS with this server certificate (its SAN must list --host).")
@click.option("--key-file", metavar="PATH", default=None, help="Private key of --cert-file.")
@click.option("--trusted-ca-file", metavar="PATH", default=None,
              help="Require client certificates signed by this CA (etcd's --client-cert-auth).")
@click.option("--max-txn-ops", type=click.IntRange(16, None), default=LAUNCHER_MAX_TXN_OPS, show_default=True,
              help="etcd's cap on operations per transaction (etcd's own default is 128). A gang's grant is one "
                   "transaction with an operation per slice; give coordinators the same --etcd-max-txn-ops.")
@click.option("--members", type=click.IntRange(1, 7), default=1, show_default=True,
              help="Run a raft group of this many members on loopback (odd; 3 survives losing one), on ports "
                   "--port, --port+2, ... (peers on the odd ports). Every pool process takes all endpoints.")
def etcd(
    port: int,
    peer_port: int | None,
    data_dir: Path | None,
    host: str,
    timeout: float,
    cert_file: str | None,
    key_file: str | None,
    trusted_ca_file: str | None,
    max_txn_ops: int,
    members: int,
) -> None:
    """Run a real etcd for one machine, in the foreground until Ctrl-C or SIGTERM.

    Prints the endpoint and the export line the other commands need:

    \b
        $ gpupool etcd --port 2379
        etcd gpupool ready on 127.0.0.1:2379 (pid ..., data ..., --max-txn-ops 1024: ...)
        export GPUPOOL_ENDPOINTS=127.0.0.1:2379

    etcd runs with --max-txn-ops 1024 (etcd's default is 128), so gangs of up to 1020 slices fit
    in one grant; start the coordinators with the same --etcd-max-txn-ops.

    Plaintext by default. With --cert-file and --key-file it serves TLS (https://), and with
    --trusted-ca-file also requires client certificates (mutual TLS):

    \b
        $ gpupool etcd --cert-file server.pem --key-file server.key --trusted-ca-file ca.pem
        export GPUPOOL_ENDPOINTS=https://127.0.0.1:2379

    With --members 3 it runs a three-member raft group on loopback (plaintext), to try
    fail-over on one machine: kill one member and the pool carries on through the others.

    \b
        $ gpupool etcd --members 3 --port 2379
        export GPUPOOL_ENDPOINTS=127.0.0.1:2379,127.0.0.1:2381,127.0.0.1:2383
    """
    if members > 1:
        _run_cluster(members, port, data_dir, host, timeout, max_txn_ops, bool(cert_file or key_file or trusted_ca_file))
        return
    # A stable peer port: a kept data dir remembers the member's peer URL across restarts.
    if peer_port is None:
        peer_port = port + 1 if port < 65535 else port - 1
    tls = None
    if cert_file or key_file or trusted_ca_file:
        if not (cert_file and key_file):
            raise click.UsageError("--cert-file and --key-file go together (TLS needs both); --trusted-ca-file needs them too")
        try:
            tls = EtcdServerTLS(cert_file, key_file, trusted_ca_file)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint=f"--{exc.field.replace('_', '-')}") from None
    server = EtcdServer(
        data_dir=data_dir or _default_data_dir(), client_port=port, peer_port=peer_port, host=host, tls=tls,
        max_txn_ops=max_txn_ops,
    )
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start(timeout=timeout)
        click.echo(
            f"etcd {server.name} ready on {server.endpoint} (pid {server.pid}, data {server.data_dir}, "
            f"--max-txn-ops {max_txn_ops}: start coordinators with --etcd-max-txn-ops {max_txn_ops})"
        )
        if tls is None:
            click.echo(f"export {ENDPOINTS_ENV}={server.endpoint}", color=False)
        else:
            click.echo(f"export {ENDPOINTS_ENV}={server.client_url}", color=False)
            if tls.trusted_ca_file:
                click.echo(
                    f"# and {CACERT_ENV}=<CA of {tls.cert_file}>, GPUPOOL_ETCD_CERT / GPUPOOL_ETCD_KEY = a client "
                    f"certificate signed by {tls.trusted_ca_file}",
                    color=False,
                )
        # Wake up now and then to notice an etcd that died under us.
        while not stop.wait(0.5):
            if not server.is_running():
                raise click.ClickException(f"etcd exited unexpectedly; see its log at {server.log_path}")
        click.echo("stopping etcd", err=True)
    finally:
        server.stop()
        for s, h in old.items():
            signal.signal(s, h)


def _run_cluster(members: int, port: int, data_dir: Path | None, host: str, timeout: float, max_txn_ops: int,
                 tls: bool) -> None:
    if tls:
        raise click.UsageError("--members > 1 runs plaintext on loopback; TLS is for a single member (drop --members)")
    if members % 2 == 0:
        raise click.BadParameter(f"{members} is even; a raft group needs an odd number of members (1, 3, 5, 7)",
                                 param_hint="--members")
    if port + 2 * members > 65536:
        raise click.BadParameter(f"ports {port}..{port + 2 * members - 1} do not all exist; choose a lower --port",
                                 param_hint="--port")
    cluster = EtcdCluster(members, data_root=data_dir or _default_data_dir(), host=host, base_port=port,
                          max_txn_ops=max_txn_ops)
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cluster.start(timeout=timeout)
        for m in cluster.members:
            click.echo(f"etcd {m.name} ready on {m.endpoint} (pid {m.pid}, data {m.data_dir})")
        click.echo(f"{members} members, --max-txn-ops {max_txn_ops}: start coordinators with --etcd-max-txn-ops {max_txn_ops}")
        click.echo(f"export {ENDPOINTS_ENV}={cluster.endpoints}", color=False)
        reported: set[str] = set()
        while not stop.wait(0.5):
            down = [m.name for m in cluster.members if not m.is_running()]
            for name in set(down) - reported:
                click.echo(f"etcd member {name} exited; the others carry on while a majority runs", err=True)
            reported = set(down)
            if len(down) == members:
                raise click.ClickException(f"every etcd member exited; see the logs beside {cluster.data_root}")
        click.echo("stopping etcd", err=True)
    finally:
        cluster.stop()
        for s, h in old.items():
            signal.signal(s, h)
