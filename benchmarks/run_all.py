"""Run every benchmark of the project and write ``docs/benchmarks.md``.

Usage::

    python benchmarks/run_all.py [--only NAME ...] [--out docs/benchmarks.md]

Each ``benchmarks/bench_*.py`` module exposes ``run() -> dict``; this runner calls them one after
another (never in parallel: they measure ratios side by side on a shared machine), records the
machine and the exact command, and renders every result as a table of flattened keys.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BENCHES = ("bench_scheduler", "bench_grant_latency", "bench_callback", "bench_allocator", "bench_simulator", "bench_timeslice")


def _load(name: str) -> Any:
    path = HERE / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        out: list[tuple[str, Any]] = []
        for k, v in obj.items():
            out.extend(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(x, dict) for x in obj):
        out = []
        for i, v in enumerate(obj):
            out.extend(_flatten(v, f"{prefix}[{i}]"))
        return out
    return [(prefix, obj)]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e6 else f"{v:,.0f}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def machine() -> dict[str, str]:
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": str(os.cpu_count()),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception:  # noqa: BLE001 - torch missing is fine for the record
        info["torch"] = "not installed"
    try:
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:  # noqa: BLE001
        info["commit"] = "unknown"
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="run only these (e.g. bench_scheduler)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = ap.parse_args(argv)
    names = [n for n in BENCHES if not args.only or n in args.only]
    raw_path = Path(args.out).with_suffix(".json")
    # With --only, the other benchmarks keep their last recorded figures (from the .json beside the report).
    previous: dict[str, Any] = json.loads(raw_path.read_text()) if args.only and raw_path.exists() else {}
    results: dict[str, Any] = {}
    for name in names:
        if not (HERE / f"{name}.py").exists():
            results[name] = {"status": "not present"}
            continue
        print(f"== {name}", flush=True)
        t0 = time.monotonic()
        try:
            results[name] = _load(name).run()
        except Exception as exc:  # noqa: BLE001 - one broken benchmark must not hide the others
            traceback.print_exc()
            results[name] = {"status": f"failed: {type(exc).__name__}: {exc}"}
        results[name] = {
            "measured": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {machine()['commit']}",
            "wall_s": round(time.monotonic() - t0, 1),
            **dict(results[name]),
        }
        print(json.dumps(results[name], default=str, indent=1)[:2000], flush=True)

    for name in BENCHES:
        if name not in results and name in previous:
            results[name] = previous[name]
    results = {n: results[n] for n in BENCHES if n in results}
    raw_path.write_text(json.dumps(results, indent=1, sort_keys=True, default=str))
    m = machine()
    cmd = "python benchmarks/run_all.py"
    lines = [
        "# Benchmarks",
        "",
        f"Written by `{cmd}` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC. One benchmark can be",
        f"rerun alone with `{cmd} --only NAME` (the others keep their figures); each section says when",
        "and at which commit it was measured (`measured`).",
        "Figures are ratios measured side by side in one run where a comparison is made; absolute",
        "times depend on the machine below (a shared 2-core VM unless it says otherwise).",
        "",
        "| machine | |",
        "| --- | --- |",
        *[f"| {k} | {v} |" for k, v in m.items()],
        "",
    ]
    for name, res in results.items():
        if name not in sys.modules and (HERE / f"{name}.py").exists():
            _load(name)  # for its docstring only
        doc = getattr(sys.modules.get(name), "__doc__", None) or ""
        lines += [f"## {name}", ""]
        if doc.strip():
            lines += [doc.strip().splitlines()[0], ""]
        lines += ["| metric | value |", "| --- | --- |"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in _flatten(res)]
        lines.append("")
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
