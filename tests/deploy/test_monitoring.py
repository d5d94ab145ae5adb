"""Alert rules and dashboard: promtool checks and unit tests, and the dashboard's consistency.

The promtool tests skip when promtool is absent (Debian: ``apt-get install prometheus``); the
same rules and every dashboard query run against a real Prometheus in
tests/telemetry/test_prometheus_live.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MON = ROOT / "deploy" / "monitoring"
RULES = MON / "gpupool-alerts.yaml"
RULE_TESTS = MON / "gpupool-alerts.test.yaml"
DASHBOARD = MON / "gpupool-dashboard.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")

#: What the issue asks the alerts to cover.
EXPECTED_ALERTS = {
    "GpupoolEtcdUnreachable", "GpupoolNoLeader", "GpupoolCoordinatorDown", "GpupoolAgentDown", "GpupoolNodeGone",
    "GpupoolGpuUnhealthy", "GpupoolJobPendingTooLong", "GpupoolJobTelemetryStale",
}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=MON, timeout=120)


@needs_promtool
def test_promtool_check_rules() -> None:
    r = _promtool("check", "rules", RULES.name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(EXPECTED_ALERTS)} rules found" in r.stdout


@needs_promtool
def test_promtool_rule_unit_tests_pass() -> None:
    r = _promtool("test", "rules", RULE_TESTS.name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@needs_promtool
def test_promtool_rule_tests_can_fail(tmp_path: Path) -> None:
    """A wrong expectation makes promtool fail: the unit tests above are not vacuous."""
    doc = yaml.safe_load(RULE_TESTS.read_text())
    doc["rule_files"] = [str(RULES)]
    doc["tests"][0]["alert_rule_test"][0]["exp_alerts"] = [{"exp_labels": {"severity": "critical"}}]
    bad = tmp_path / "bad.test.yaml"
    bad.write_text(yaml.safe_dump(doc))
    r = subprocess.run(["promtool", "test", "rules", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0


def test_every_alert_is_unit_tested_and_documented() -> None:
    rules = yaml.safe_load(RULES.read_text())
    names = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert names == EXPECTED_ALERTS
    tested = {t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"] for t in case["alert_rule_test"]}
    assert tested == names
    doc = METRICS_DOC.read_text()
    for name in names:
        assert name in doc, f"{name} is not described in docs/metrics.md"
    for r in (r for g in rules["groups"] for r in g["rules"]):
        assert r["labels"]["severity"] in {"critical", "warning", "info"}
        assert r["annotations"]["summary"] and r["annotations"]["description"]


def test_dashboard_is_what_the_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location("make_dashboard", MON / "make_dashboard.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert DASHBOARD.read_text() == mod.render(), "run python deploy/monitoring/make_dashboard.py"


def test_dashboard_panels_cover_the_pool_and_use_documented_metrics() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "gpupool-pool"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Pool", "Queue and scheduler", "Jobs", "Cost"]
    doc = METRICS_DOC.read_text()
    used = {
        m
        for p in board["panels"]
        for t in p.get("targets", [])
        for m in re.findall(r"\bgpupool_[a-z_]+", t["expr"])
    }
    base = {re.sub(r"_(bucket|sum|count)$", "", m) for m in used}
    missing = sorted(m for m in base if m not in doc)
    assert not missing, f"metrics on the dashboard but not in docs/metrics.md: {missing}"
