"""The API reference builds from the docstrings (pdoc), with a page for every public module."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("pdoc", reason="pip install pdoc")


def _builder():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("build_api", ROOT / "docs" / "build_api.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_api_reference_builds_with_a_page_per_module(tmp_path: Path) -> None:
    modules, warnings = _builder().build(tmp_path)
    assert "gpupool_sdk.client.pool" in modules and "gpupool_sdk.telemetry.prometheus" in modules
    for name in modules:
        page = tmp_path / (name.replace(".", "/") + ".html")
        if not page.exists():  # a package's page
            page = tmp_path / name.replace(".", "/") / "index.html"
        assert page.exists() or (tmp_path / (name.replace(".", "/") + ".html")).exists(), f"no page for {name}"
    # A module that does not import is a broken reference (lazy names in __all__ are only warnings).
    broken = [w for w in warnings if re.search(r"(?i)error importing|failed to import|cannot import", w)
              and "does not resolve" not in w]
    assert not broken, broken
    pool = (tmp_path / "gpupool_sdk" / "client" / "pool.html").read_text()
    assert "PoolClient" in pool and "acquire" in pool
    prom = (tmp_path / "gpupool_sdk" / "telemetry" / "prometheus.html").read_text()
    assert "serve_metrics" in prom and "dcgm-exporter" in prom
