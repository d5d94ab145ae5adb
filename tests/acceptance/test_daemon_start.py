"""The daemons started before etcd (a pod or unit beside it, a loaded machine) wait for it.

``gpupool coordinator`` and ``gpupool agent`` try etcd for up to one TTL at start, saying so on
stderr, and then run as usual; a wrong endpoint still exits 3 (``test_cli_contract``). Real
processes, a real etcd started on the port they were told after they are already retrying.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from testkit import wait_for

from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.launcher import EtcdServer

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_coordinator_and_agent_started_before_etcd_wait_for_it_and_then_run(tmp_path: Path) -> None:
    port = _free_port()
    endpoint = f"127.0.0.1:{port}"
    cli = [sys.executable, "-m", "gpupool_sdk.cli.main"]
    prefix = ["--endpoints", endpoint, "--prefix", "/daemon-start"]
    procs: dict[str, tuple[subprocess.Popen[str], Path]] = {}
    for name, args in (("coordinator", ["coordinator", "--ttl", "60", "--loop-wait", "0.3"]),
                       ("agent", ["agent", "--simulate", "n1:1xT4", "--ttl", "60"])):  # fmt: skip
        log = tmp_path / f"{name}.log"
        with log.open("w") as f:
            procs[name] = (subprocess.Popen([*cli, *args, *prefix], stdout=f, stderr=subprocess.STDOUT, text=True,
                                            cwd=ROOT), log)  # fmt: skip
    server: EtcdServer | None = None
    store: EtcdStore | None = None
    try:
        # Both are retrying before etcd exists (and neither has given up).
        wait_for(lambda: all("etcd unreachable" in log.read_text() and "retrying in" in log.read_text()
                             for _, log in procs.values()), 60, "both daemons to report the retries")  # fmt: skip
        assert all(p.poll() is None for p, _ in procs.values()), {n: log.read_text() for n, (_, log) in procs.items()}
        server = EtcdServer(data_dir=tmp_path / "etcd", client_port=port, name="late").start(timeout=60)
        store = EtcdStore(server.endpoint, keyspace=Keyspace("/daemon-start"))
        st = store
        wait_for(lambda: st.get(st.keys.leader()) is not None, 60, "the coordinator to lead")
        wait_for(lambda: st.get_prefix(st.keys.gpus_prefix())[0], 60, "the agent to publish its GPU")
        assert all(p.poll() is None for p, _ in procs.values())
    finally:
        for p, _ in procs.values():
            p.terminate()
        for p, _ in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if store is not None:
            store.close()
        if server is not None:
            server.stop()
