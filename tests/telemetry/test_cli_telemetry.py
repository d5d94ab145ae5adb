"""``gpupool top`` and ``gpupool metrics report`` against a real etcd, through click's CliRunner."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpupool_sdk.cli.main import cli
from gpupool_sdk.store.keyspace import Keyspace

from ._data import READINGS, populate


@pytest.fixture
def prices_file(tmp_path: Path) -> Path:
    p = tmp_path / "prices.json"
    p.write_text(json.dumps({"models": {"H100-80GB": 4.0}}))
    return p


def _run(args: list[str], endpoint: str, keyspace: Keyspace, prices_file: Path | None = None) -> Any:
    extra = ["--endpoints", endpoint, "--prefix", keyspace.prefix]
    if prices_file is not None:
        extra += ["--prices", str(prices_file)]
    return CliRunner().invoke(cli, [*args, *extra], catch_exceptions=False)


def test_top_json(store: Any, etcd_endpoint: str, keyspace: Keyspace, prices_file: Path) -> None:
    populate(store)
    res = _run(["top", "-o", "json"], etcd_endpoint, keyspace, prices_file)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    jobs = {j["job"]: j for j in doc["jobs"]}
    assert set(jobs) == {"bert", "loader", "waiting", "old-run"}
    assert jobs["bert"]["state"] == "GRANTED" and jobs["bert"]["slices"] == 1
    assert jobs["bert"]["dominant_phase"] == "backward"
    assert jobs["bert"]["memory_quota_bytes"] == 40 * 2**30
    assert jobs["bert"]["cost_usd_per_hour"] == pytest.approx(2.0)
    assert jobs["loader"]["phase_fraction"]["data"] > 0.5
    assert jobs["waiting"]["state"] == "PENDING" and jobs["waiting"]["steps_per_s"] is None
    assert jobs["old-run"]["state"] == "GONE" and jobs["old-run"]["cost_usd"] == 3.0
    gpus = {g["gpu"]: g for g in doc["gpus"]}
    assert gpus["GPU-a0"]["jobs"] == ["bert", "loader"]
    assert gpus["GPU-a0"]["compute_allocated"] == pytest.approx(0.75)
    assert gpus["GPU-a1"]["cordoned"] and not gpus["GPU-a1"]["healthy"]
    assert doc["leader"]["term"] == 7
    # the malformed value is reported (JSON and stderr) and skipped
    assert len(doc["errors"]) == 1 and "telemetry/broken" in doc["errors"][0]
    assert "telemetry/broken" in res.stderr


def test_top_shows_the_agents_device_readings(store: Any, etcd_endpoint: str, keyspace: Keyspace) -> None:
    populate(store)
    doc = json.loads(_run(["top", "-o", "json"], etcd_endpoint, keyspace).stdout)
    gpus = {g["gpu"]: g for g in doc["gpus"]}
    assert gpus["GPU-a0"]["readings"] == READINGS
    assert set(gpus["GPU-a1"]["readings"]) == set(READINGS) and not any(gpus["GPU-a1"]["readings"].values())
    out = _run(["top"], etcd_endpoint, keyspace).stdout
    header = _header(out, "GPU")
    a0 = next(line for line in out.splitlines() if line.startswith("node-a/0 "))
    assert a0.index("91%") == header.index("DEV UTIL")  # the device's, whoever runs on it
    assert "PCIE TX/RX" not in header
    wide = _run(["top", "-o", "wide"], etcd_endpoint, keyspace).stdout
    header = _header(wide, "GPU")
    a0 = next(line for line in wide.splitlines() if line.startswith("node-a/0 "))
    for column, cell in (("TEMP", "63C"), ("POWER", "455W"), ("MEM BW", "47%"), ("DEV MEM", "52.0GiB"),
                         ("PCIE TX/RX", "1.5GiB/s/3.0GiB/s"), ("NVLINK TX/RX", "120.0GiB/s/110.0GiB/s")):
        assert a0.index(cell) == header.index(column), (column, a0)
    a1 = next(line for line in wide.splitlines() if line.startswith("node-a/1 "))
    for column in ("DEV UTIL", "PCIE TX/RX", "NVLINK TX/RX"):
        assert a1[header.index(column)] == "-", column  # unknown (a simulated GPU): a dash, not 0



@pytest.mark.parametrize("garbage", [b"{oops", b'{"schema": 1, "utilization": 7}', b'{"schema": 9}'])
def test_garbage_under_a_readings_key_is_named_and_shown_as_unknown(
    store: Any, etcd_endpoint: str, keyspace: Keyspace, garbage: bytes
) -> None:
    populate(store)
    key = keyspace.readings("node-a", "GPU-a0")
    store.put(key, garbage)
    res = _run(["top", "-o", "json"], etcd_endpoint, keyspace)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [e for e in doc["errors"] if e.startswith(key)], doc["errors"]
    a0 = next(g for g in doc["gpus"] if g["gpu"] == "GPU-a0")["readings"]
    assert a0["utilization"] is None and a0["temperature_c"] == READINGS["temperature_c"]
    assert _run(["top", "-o", "wide"], etcd_endpoint, keyspace).exit_code == 0

def test_top_table(store: Any, etcd_endpoint: str, keyspace: Keyspace, prices_file: Path) -> None:
    populate(store)
    res = _run(["top"], etcd_endpoint, keyspace, prices_file)
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "leader: coord-1 (term 7)" in out
    for word in ("bert", "loader", "GRANTED", "PENDING", "node-a/0", "UNHEALTHY,cordoned"):
        assert word in out
    assert "[" in out and "B" in out  # the phase bar


BOX_DRAWING = re.compile("[\u2500-\u257f]")


def _header(out: str, first: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(first + " "))


def test_top_plain_tables_are_aligned_columns(
    store: Any, etcd_endpoint: str, keyspace: Keyspace, prices_file: Path
) -> None:
    """Not a terminal (CliRunner's stdout): plain columns, a header row, rows aligned under it."""
    populate(store)
    out = _run(["top"], etcd_endpoint, keyspace, prices_file).stdout
    assert not BOX_DRAWING.search(out) and "\x1b[" not in out, out
    jobs_header = _header(out, "JOB")
    assert re.match(r"JOB\s{3,}STATE\s{3,}QOS\s{3,}SLICES", jobs_header), jobs_header
    bert = next(line for line in out.splitlines() if line.startswith("bert "))
    assert bert.index("GRANTED") == jobs_header.index("STATE")
    gpus_header = _header(out, "GPU")
    a1 = next(line for line in out.splitlines() if line.startswith("node-a/1 "))
    assert a1.index("UNHEALTHY,cordoned") == gpus_header.index("HEALTH")
    # wide-only columns stay out of the default table
    assert "OWNER" not in jobs_header and "UUID" not in gpus_header
    assert out.splitlines()[1].startswith("jobs (phases: D data")  # the title, on a line of its own


def test_top_wide_and_no_headers(store: Any, etcd_endpoint: str, keyspace: Keyspace, prices_file: Path) -> None:
    populate(store)
    wide = _run(["top", "-o", "wide"], etcd_endpoint, keyspace, prices_file)
    assert wide.exit_code == 0, wide.output
    jobs_header = _header(wide.stdout, "JOB")
    assert "OWNER" in jobs_header and "PRIO" in jobs_header and "TELEMETRY AGE" in jobs_header
    bert = next(line for line in wide.stdout.splitlines() if line.startswith("bert "))
    assert bert.index("nlp") == jobs_header.index("OWNER")
    gpus_header = _header(wide.stdout, "GPU")
    assert "UUID" in gpus_header and "HEALTH REASONS" in gpus_header
    a1 = next(line for line in wide.stdout.splitlines() if line.startswith("node-a/1 "))
    assert a1.index("GPU-a1") == gpus_header.index("UUID") and "xid 79" in a1

    bare = _run(["top", "--no-headers"], etcd_endpoint, keyspace, prices_file)
    assert bare.exit_code == 0, bare.output
    lines = bare.stdout.splitlines()
    assert not any(line.startswith(("JOB ", "GPU ", "jobs", "gpus")) for line in lines), bare.stdout
    # rows only after the leader line (a blank line between the tables): every job and GPU, name first
    firsts = {line.split()[0] for line in lines[1:] if line}
    assert {"bert", "loader", "waiting", "old-run", "node-a/0", "node-a/1"} <= firsts


def test_top_yaml_is_the_json_document(store: Any, etcd_endpoint: str, keyspace: Keyspace) -> None:
    import yaml

    populate(store)
    y = _run(["top", "-o", "yaml"], etcd_endpoint, keyspace)
    j = _run(["top", "-o", "json"], etcd_endpoint, keyspace)
    assert y.exit_code == 0 and j.exit_code == 0, y.output + j.output
    ydoc, jdoc = yaml.safe_load(y.stdout), json.loads(j.stdout)
    assert [r["job"] for r in ydoc["jobs"]] == [r["job"] for r in jdoc["jobs"]]
    assert ydoc["gpus"] == jdoc["gpus"]


def test_top_on_a_terminal_draws_rich_tables(
    store: Any, etcd_endpoint: str, keyspace: Keyspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where stdout is a terminal the same tables are drawn by rich (one table code path: cli/output.py)."""
    import gpupool_sdk.cli.top_cmd as top_cmd

    populate(store)
    monkeypatch.setattr(top_cmd, "is_terminal", lambda: True)
    monkeypatch.setenv("COLUMNS", "300")
    out = _run(["top"], etcd_endpoint, keyspace).stdout
    assert BOX_DRAWING.search(out), out
    assert "bert" in out and "node-a/1" in out and "UNHEALTHY,cordoned" in out


def test_metrics_report_plain_wide_and_no_headers(
    store: Any, etcd_endpoint: str, keyspace: Keyspace, prices_file: Path
) -> None:
    populate(store)
    out = _run(["metrics", "report"], etcd_endpoint, keyspace, prices_file).stdout
    assert not BOX_DRAWING.search(out), out
    header = _header(out, "JOB")
    assert "GPU-H BY MODEL" not in header
    bert = next(line for line in out.splitlines() if line.startswith("bert "))
    assert bert.index("nlp") == header.index("OWNER")
    wide = _run(["metrics", "report", "-o", "wide"], etcd_endpoint, keyspace, prices_file).stdout
    wide_header = _header(wide, "JOB")
    wide_bert = next(line for line in wide.splitlines() if line.startswith("bert "))
    assert "GPU-H BY MODEL" in wide_header  # its usage record has no per-model split: "-"
    assert wide_bert[wide_header.index("GPU-H BY MODEL"):].startswith("- ")
    bare = _run(["metrics", "report", "--no-headers"], etcd_endpoint, keyspace, prices_file).stdout
    assert "cost by job" not in bare and not any(line.startswith("JOB ") for line in bare.splitlines())
    assert any(line.startswith("bert ") for line in bare.splitlines())


def test_metrics_report_json(store: Any, etcd_endpoint: str, keyspace: Keyspace, prices_file: Path) -> None:
    populate(store)
    res = _run(["metrics", "report", "-o", "json"], etcd_endpoint, keyspace, prices_file)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [j["job"] for j in doc["jobs"]] == ["bert", "old-run"]  # most expensive first
    owners = {o["owner"]: o for o in doc["owners"]}
    assert owners["nlp"]["cost_usd"] == 8.0 and owners["cv"]["cost_usd"] == 3.0
    assert doc["total_cost_usd"] == 11.0
    assert doc["cost_usd_per_hour"] == pytest.approx(2.5)
    kinds = {(a["job"], a["kind"]) for a in doc["advice"]}
    assert ("bert", "memory_oversized") in kinds
    assert ("loader", "input_bound") in kinds
    bert_mem = next(a for a in doc["advice"] if a["kind"] == "memory_oversized")
    assert bert_mem["suggestion"]["memory_bytes"] == 12 * 2**30
    assert doc["saving_usd_per_hour"] > 0
    assert len(doc["errors"]) == 1


def test_metrics_report_table(store: Any, etcd_endpoint: str, keyspace: Keyspace, prices_file: Path) -> None:
    populate(store)
    res = _run(["metrics", "report"], etcd_endpoint, keyspace, prices_file)
    assert res.exit_code == 0, res.output
    assert "cost by owner" in res.stdout and "memory_oversized" in res.stdout and "input-bound" in res.stdout


def test_empty_pool(etcd_endpoint: str, keyspace: Keyspace) -> None:
    res = _run(["top", "-o", "json"], etcd_endpoint, keyspace)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["jobs"] == [] and doc["gpus"] == [] and doc["leader"] is None


@pytest.mark.parametrize("args", [["top"], ["metrics", "report", "-o", "json"], ["metrics", "serve", "--port", "0"]])
def test_unreachable_etcd_exits_3_naming_the_endpoint(args: list[str]) -> None:
    res = CliRunner().invoke(cli, [*args, "--endpoints", "127.0.0.1:1", "--timeout", "0.5"])
    assert res.exit_code == 3, res.output
    assert "127.0.0.1:1" in res.stderr and "unreachable" in res.stderr


def test_bad_price_file_is_a_usage_error(tmp_path: Path, etcd_endpoint: str, keyspace: Keyspace) -> None:
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"models": {"H100-80GB": -3}}))
    res = _run(["metrics", "report"], etcd_endpoint, keyspace, bad)
    assert res.exit_code == 2
    assert "H100-80GB" in res.output and "--prices" in res.output


def test_bad_watch_interval(etcd_endpoint: str, keyspace: Keyspace) -> None:
    res = _run(["top", "-w", "0"], etcd_endpoint, keyspace)
    assert res.exit_code == 2 and "--watch" in res.output


def test_metrics_serve_process(store: Any, etcd_endpoint: str, keyspace: Keyspace, prices_file: Path) -> None:
    """The real command in its own process: serves, is scraped, stops cleanly on SIGTERM."""
    import signal
    import subprocess
    import sys
    import urllib.request

    populate(store)
    cmd = [sys.executable, "-m", "gpupool_sdk.cli.main", "metrics", "serve", "--port", "0", "--addr", "127.0.0.1",
           "--endpoints", etcd_endpoint, "--prefix", keyspace.prefix, "--prices", str(prices_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving gpupool metrics on http://127.0.0.1:" in line, line + (proc.stderr.read() if proc.stderr else "")
        url = line.split(" on ", 1)[1].split(" ", 1)[0]
        with urllib.request.urlopen(url, timeout=30) as resp:
            text = resp.read().decode()
        assert 'gpupool_job_cost_usd_total{job_name="bert",owner="nlp"} 8.0' in text
        assert "gpupool_leader_term 7.0" in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_watch_renders_until_interrupted(
    store: Any, etcd_endpoint: str, keyspace: Keyspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpupool_sdk.cli.common as common

    populate(store)
    sleeps: list[float] = []

    def fake_sleep(s: float) -> None:
        sleeps.append(s)
        if len(sleeps) == 2:
            raise KeyboardInterrupt  # Ctrl-C during the second wait

    monkeypatch.setattr(common, "_sleep", fake_sleep)
    res = _run(["top", "-o", "json", "-w", "2"], etcd_endpoint, keyspace)
    assert res.exit_code == 0, res.output
    assert sleeps == [2.0, 2.0]
    assert res.stdout.count('"revision"') == 2  # two refreshes, each a full document


def test_watch_loop_backs_off_while_etcd_is_unreachable_and_resets_after_a_good_read(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gpupool_sdk.cli.common as common
    from gpupool_sdk.errors import StoreUnavailableError

    reads = iter([StoreUnavailableError("etcd at 127.0.0.1:1 unreachable")] * 6 + [1, StoreUnavailableError("down"), 2])
    sleeps: list[float] = []
    shown: list[tuple[int, bool]] = []

    def read() -> int:
        item = next(reads)
        if isinstance(item, Exception):
            raise item
        return item

    def fake_sleep(s: float) -> None:
        sleeps.append(s)
        if len(sleeps) == 9:
            raise KeyboardInterrupt

    monkeypatch.setattr(common, "_sleep", fake_sleep)
    common.watch_loop("127.0.0.1:1", 5.0, read, lambda v, watching: shown.append((v, watching)))
    assert sleeps == [5.0, 10.0, 20.0, 30.0, 30.0, 30.0, 5.0, 5.0, 5.0]
    assert shown == [(1, True), (2, True)]
    assert "retrying in 20s" in capsys.readouterr().err


def test_reports_price_with_the_leaders_published_table_unless_given_one(
    store: Any, etcd_endpoint: str, keyspace: Keyspace, prices_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The policy file's [prices] reach `gpupool top` and `metrics report` through `{prefix}/prices`."""
    from gpupool_sdk.telemetry.pricing import CATALOG_PRICES_ENV, PRICES_ENV, PriceTable

    monkeypatch.delenv(PRICES_ENV, raising=False)
    monkeypatch.delenv(CATALOG_PRICES_ENV, raising=False)
    populate(store)
    store.put(keyspace.prices(), PriceTable(overrides={"H100-80GB": 6.0}))

    def bert_rate(*args: str, prices: Path | None = None) -> float:
        res = _run(["top", "-o", "json", *args], etcd_endpoint, keyspace, prices)
        assert res.exit_code == 0, res.output
        return float({j["job"]: j for j in json.loads(res.stdout)["jobs"]}["bert"]["cost_usd_per_hour"])

    assert bert_rate() == pytest.approx(3.0)  # the published 6.0 x bert's half GPU
    assert bert_rate(prices=prices_file) == pytest.approx(2.0)  # --prices wins
    monkeypatch.setenv(PRICES_ENV, str(prices_file))
    assert bert_rate() == pytest.approx(2.0)  # so does $GPUPOOL_PRICES
    monkeypatch.delenv(PRICES_ENV)
    rate = {}
    for given in (None, prices_file):
        res = _run(["metrics", "report", "-o", "json"], etcd_endpoint, keyspace, given)
        assert res.exit_code == 0, res.output
        rate[given] = json.loads(res.stdout)["cost_usd_per_hour"]
    assert rate[None] == pytest.approx(1.5 * rate[prices_file])  # 6.0 against 4.0 per H100-hour
    # A hand-edited, malformed table is reported naming its key, and the catalog prices are used.
    store.put(keyspace.prices(), {"models": {"H100-80GB": "six"}})
    res = _run(["top", "-o", "json"], etcd_endpoint, keyspace)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert any("prices" in e and "models.H100-80GB" in e for e in doc["errors"])
