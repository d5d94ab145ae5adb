"""``gpupool etcd``: run a real single-member etcd on loopback in the foreground."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import FrameType

import click

from gpupool_sdk.cli.common import ENDPOINTS_ENV
from gpupool_sdk.store.launcher import EtcdServer


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
def etcd(port: int, peer_port: int | None, data_dir: Path | None, host: str, timeout: float) -> None:
    """Run a real etcd for one machine, in the foreground until Ctrl-C or SIGTERM.

    Prints the endpoint and the export line the other commands need:

    \b
        $ gpupool etcd --port 2379
        etcd gpupool ready on 127.0.0.1:2379 (pid ..., data ...)
        export GPUPOOL_ENDPOINTS=127.0.0.1:2379
    """
    # A stable peer port: a kept data dir remembers the member's peer URL across restarts.
    if peer_port is None:
        peer_port = port + 1 if port < 65535 else port - 1
    server = EtcdServer(data_dir=data_dir or _default_data_dir(), client_port=port, peer_port=peer_port, host=host)
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start(timeout=timeout)
        click.echo(f"etcd {server.name} ready on {server.endpoint} (pid {server.pid}, data {server.data_dir})")
        click.echo(f"export {ENDPOINTS_ENV}={server.endpoint}", color=False)
        # Wake up now and then to notice an etcd that died under us.
        while not stop.wait(0.5):
            if not server.is_running():
                raise click.ClickException(f"etcd exited unexpectedly; see its log at {server.log_path}")
        click.echo("stopping etcd", err=True)
    finally:
        server.stop()
        for s, h in old.items():
            signal.signal(s, h)
