"""A real Prometheus on loopback scrapes a real coordinator, agent and job, and dcgm-exporter's sample.

What it shows, against processes started here (etcd of its own, so it can be stopped):

* the alert rules of ``deploy/monitoring/gpupool-alerts.yaml`` load into Prometheus and evaluate
  without error, and their queries return nothing while the pool is healthy;
* every query of the Grafana dashboard runs;
* a ``gpupool_*`` series joins a dcgm-exporter series with ``on(UUID)``, no ``label_replace``;
* the queries fire on injected faults: the agent stopped (``GpupoolNodeGone``,
  ``GpupoolAgentDown``), then etcd stopped (``GpupoolEtcdUnreachable``, ``GpupoolNoLeader``).

Queries are the rules' own ``expr`` sent to ``/api/v1/query`` (their ``for:`` durations are
covered by ``promtool test rules`` in tests/deploy). Skips when ``prometheus`` is not installed
(Debian: ``apt-get install prometheus``).
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from testkit import dump_logs_if_failed, stop_groups, wait_for

from gpupool_sdk.resources import JobSpec
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.launcher import EtcdServer, free_port

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "monitoring" / "gpupool-alerts.yaml"
DASHBOARD = ROOT / "deploy" / "monitoring" / "gpupool-dashboard.json"
DCGM_SAMPLE = Path(__file__).with_name("data") / "dcgm-exporter-sample.prom"
PREFIX = "/gpupool-prom-test"
TIMEOUT = 90.0

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (apt-get install prometheus)")


def _alert_exprs() -> dict[str, str]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


class _Static(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


class Live:
    """The processes of one test, and a Prometheus query helper."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.names: dict[str, subprocess.Popen[bytes]] = {}
        self.prom_port = free_port()

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append(p)
        self.names[name] = p
        return p

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as resp:
            doc = json.loads(resp.read())
        assert doc["status"] == "success", doc
        return list(doc["data"]["result"])

    def api(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.prom_port}{path}", timeout=10) as resp:
            return json.loads(resp.read())["data"]

    def wait_query(self, promql: str, what: str, pred: Any = bool) -> list[dict[str, Any]]:
        def check() -> list[dict[str, Any]] | None:
            try:
                got = self.query(promql)
            except OSError:
                return None
            return got if pred(got) else None

        return wait_for(check, TIMEOUT, what, interval=0.5)


@pytest.fixture
def live(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Live]:
    lv = Live(tmp_path)
    try:
        yield lv
    finally:
        stop_groups(lv.procs)
        dump_logs_if_failed(request, tmp_path)


def test_prometheus_scrapes_exporters_joins_dcgm_and_alerts_fire(live: Live, tmp_path: Path) -> None:
    etcd = EtcdServer(data_dir=tmp_path / "etcd", name="prom-test")
    etcd.start(timeout=60)
    dcgm = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Dcgm", (_Static,), {"body": DCGM_SAMPLE.read_bytes()}))
    threading.Thread(target=dcgm.serve_forever, daemon=True).start()
    try:
        _run(live, etcd, dcgm.server_address[1])
    finally:
        dcgm.shutdown()
        dcgm.server_close()
        etcd.stop()


def _run(live: Live, etcd: EtcdServer, dcgm_port: int) -> None:
    cli = [sys.executable, "-m", "gpupool_sdk.cli.main"]
    common = ["--endpoints", etcd.endpoint, "--prefix", PREFIX]
    coord_port, agent_port, job_port = free_port(), free_port(), free_port()
    live.spawn("coordinator", [*cli, "coordinator", *common, "--id", "c1", "--ttl", "4", "--loop-wait", "0.5",
                               "--retry-timeout", "0.75", "--metrics-port", str(coord_port), "--metrics-addr", "127.0.0.1"])
    live.spawn("agent", [*cli, "agent", *common, "--simulate", "node-a:2xH100-80GB:nvlink", "--ttl", "6",
                         "--refresh", "0.5", "--metrics-port", str(agent_port), "--metrics-addr", "127.0.0.1"])
    store = EtcdStore(etcd.endpoint, keyspace=Keyspace(PREFIX))
    try:
        wait_for(lambda: store.get(store.keys.leader()), TIMEOUT, "a leader")
        wait_for(lambda: store.get_prefix(store.keys.gpus_prefix())[0], TIMEOUT, "the agent's GPUs")
    finally:
        store.close()
    spec = JobSpec(name="bert", gpus=1, memory="20Gi", compute_share=0.5, qos="guaranteed", owner="nlp")
    live.spawn("job", [sys.executable, str(Path(__file__).with_name("job_exporter_proc.py")), etcd.endpoint, PREFIX,
                       json.dumps(spec.to_dict()), str(job_port)])
    wait_for(lambda: "SERVING" in live.log("job"), TIMEOUT, "the job to be granted and serve metrics")

    config = {
        # The coordinator's metrics read of etcd gives up after 2 s: a 3 s scrape timeout sees its answer.
        "global": {"scrape_interval": "3s", "scrape_timeout": "3s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "gpupool-coordinator", "static_configs": [{"targets": [f"127.0.0.1:{coord_port}"]}]},
            {"job_name": "gpupool-agent", "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"]}]},
            {"job_name": "gpupool-job", "static_configs": [{"targets": [f"127.0.0.1:{job_port}"]}]},
            {"job_name": "dcgm-exporter", "static_configs": [{"targets": [f"127.0.0.1:{dcgm_port}"]}]},
        ],
    }
    (live.tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    prom = shutil.which("prometheus")
    assert prom is not None
    live.spawn("prometheus", [prom, f"--config.file={live.tmp / 'prometheus.yml'}",
                              f"--storage.tsdb.path={live.tmp / 'tsdb'}",
                              f"--web.listen-address=127.0.0.1:{live.prom_port}"])

    # Every target is up and each exporter's own series are there.
    live.wait_query("up == 1", "all four targets up", lambda r: len(r) == 4)
    live.wait_query('gpupool_job_step{job="gpupool-job",job_name="bert"}', "the job exporter's step")
    live.wait_query('gpupool_agent_gpu_healthy{job="gpupool-agent"} == 1', "the agent's GPUs", lambda r: len(r) == 2)
    live.wait_query("gpupool_coordinator_is_leader == 1", "the coordinator leading")
    live.wait_query('gpupool_scheduler_grants_total{qos="guaranteed"} >= 1', "the grant counted")
    live.wait_query('gpupool_slice_memory_allocated_bytes{job_name="bert"}', "bert's slice")
    live.wait_query("gpupool_node_info", "the node record")

    # The rules loaded and evaluate without error; while healthy, none of their queries returns anything.
    exprs = _alert_exprs()
    rules = wait_for(
        lambda: [r for g in live.api("/api/v1/rules")["groups"] for r in g["rules"] if r.get("lastEvaluation", "").startswith("2")]
        or None, TIMEOUT, "rules evaluated",
    )
    assert {r["name"] for r in rules} == set(exprs)
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    for name, expr in exprs.items():
        assert live.query(expr) == [], f"{name} fires on a healthy pool"

    # Every query of the Grafana dashboard runs (Grafana's interval variables filled in).
    board = json.loads(DASHBOARD.read_text())
    exprs_on_board = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs_on_board) > 20
    for expr in exprs_on_board:
        live.query(expr.replace("$__rate_interval", "10s").replace("$__range", "1h"))
    assert live.query("sum(gpupool_gpu_healthy)")[0]["value"][1] == "2"

    # The join with dcgm-exporter by UUID, no label_replace: bert's slice with DCGM's bus id and memory.
    joined = live.query(
        'gpupool_slice_memory_allocated_bytes{job_name="bert"} / on(UUID) group_left(pci_bus_id, device) '
        "(DCGM_FI_DEV_FB_USED * 1024 * 1024)"
    )
    assert len(joined) == 1, joined
    j = joined[0]["metric"]
    assert j["job_name"] == "bert" and j["UUID"] == "GPU-sim-node-a-0" and j["device"] == "nvidia0", j
    assert j["pci_bus_id"] == "00000000:18:00.0"
    assert float(joined[0]["value"][1]) == pytest.approx(20 / 40)  # 20 GiB granted, 40 GiB used per DCGM
    # gpu (the index), Hostname and modelName have DCGM's names and meanings: the index matches too.
    same_index = live.query('gpupool_gpu_memory_bytes * 0 + on(UUID, gpu) group_left DCGM_FI_DEV_GPU_TEMP')
    assert {r["metric"]["UUID"] for r in same_index} == {"GPU-sim-node-a-0", "GPU-sim-node-a-1"}

    # Fault 1: the agent stops (SIGTERM revokes its lease: the node's keys vanish).
    agent = live.names["agent"]
    os.killpg(agent.pid, signal.SIGTERM)
    agent.wait(30)
    gone = live.wait_query(exprs["GpupoolNodeGone"], "GpupoolNodeGone's query to fire")
    assert [r["metric"]["node"] for r in gone] == ["node-a"]
    down = live.wait_query(exprs["GpupoolAgentDown"], "GpupoolAgentDown's query to fire")
    assert [r["metric"]["job"] for r in down] == ["gpupool-agent"]
    assert live.query(exprs["GpupoolEtcdUnreachable"]) == []

    # Fault 2: etcd stops. The coordinator's exporter still answers, with gpupool_store_up 0, and
    # the coordinator steps down: no leader.
    etcd.stop()
    unreachable = live.wait_query(exprs["GpupoolEtcdUnreachable"], "GpupoolEtcdUnreachable's query to fire")
    assert [r["metric"]["job"] for r in unreachable] == ["gpupool-coordinator"]
    live.wait_query(exprs["GpupoolNoLeader"], "GpupoolNoLeader's query to fire")
    # The node-gone rule stays quiet while etcd is down (every node vanishes from the pool's view then).
    assert live.query(exprs["GpupoolNodeGone"]) == []
