#!/usr/bin/env python
"""What the agent's per-refresh usage reads cost on a real GPU, and whether their units hold.

``python benchmarks/bench_nvml_usage.py --json`` (run by ``scripts/gpu_checks.sh``) prints:

- ``call_us``: median microseconds of each NVML call the agent makes per GPU per refresh
  (``nvmlDeviceGetUtilizationRates``, ``nvmlDeviceGetMemoryInfo``, the one
  ``nvmlDeviceGetFieldValues`` for the PCIe and NVLink counters) and of the fallback
  ``nvmlDeviceGetPcieThroughput`` (documented to sample 20 ms), plus one whole
  ``NvmlBackend.gpus()`` refresh;
- ``fields``: which counter fields this driver supports (``nvmlReturn`` per field);
- ``h2d``: with torch and CUDA, host-to-device copies of a pinned buffer for a few seconds: the
  bytes copied per second, the PCIe RX rate from the two counter readings, and
  ``nvmlDeviceGetPcieThroughput(RX)`` x 1024 sampled during the copies (the agent takes its
  KB/s as KiB/s: the ratios say whether that holds);
- ``gpus``: one refresh's published GPU records, and ``readings``: its usage readings by GPU UUID
  (the values of ``readings/{node}/{uuid}``, as the agent publishes them).

Exit code 0 when NVML initialises, 2 when it does not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from typing import Any

ALL_LINKS = 0xFFFFFFFF


def _median_us(fn: Any, n: int = 20) -> float | None:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:
            return None
        times.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(times), 1)


def _counters(nv: Any, h: Any) -> dict[str, tuple[int, int, int]]:
    """field name -> (nvmlReturn, value, timestamp µs)."""
    names = ["NVML_FI_DEV_PCIE_COUNT_TX_BYTES", "NVML_FI_DEV_PCIE_COUNT_RX_BYTES",
             "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX"]
    names = [n for n in names if hasattr(nv, n)]
    ids = [(getattr(nv, n), ALL_LINKS if "NVLINK" in n else 0) for n in names]
    vals = nv.nvmlDeviceGetFieldValues(h, ids)
    return {n: (int(v.nvmlReturn), int(v.value.ullVal), int(v.timestamp)) for n, v in zip(names, vals, strict=True)}


def _h2d(nv: Any, h: Any, seconds: float) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"skipped": "CUDA is not available to torch"}
    src = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    stop = threading.Event()
    copied = [0]

    def copy() -> None:
        while not stop.is_set():
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            copied[0] += src.numel()

    t = threading.Thread(target=copy, daemon=True)
    t.start()
    time.sleep(0.5)  # let the copies reach their steady rate
    c0, t0, b0 = _counters(nv, h), time.perf_counter(), copied[0]
    sampled = []
    while time.perf_counter() - t0 < seconds:
        try:
            sampled.append(nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES) * 1024)
        except nv.NVMLError as exc:
            sampled.append(str(exc))
            break
    c1, t1, b1 = _counters(nv, h), time.perf_counter(), copied[0]
    stop.set()
    t.join(10)
    copied_rate = (b1 - b0) / (t1 - t0)
    out: dict[str, Any] = {"copied_bytes_per_s": round(copied_rate)}
    rx = "NVML_FI_DEV_PCIE_COUNT_RX_BYTES"
    if rx in c0 and c0[rx][0] == 0 and c1[rx][0] == 0 and c1[rx][2] > c0[rx][2]:
        rate = (c1[rx][1] - c0[rx][1]) / ((c1[rx][2] - c0[rx][2]) / 1e6)
        out["counter_rx_bytes_per_s"] = round(rate)
        out["counter_over_copied"] = round(rate / copied_rate, 3)
    numbers = [s for s in sampled if isinstance(s, (int, float))]
    if numbers:
        out["throughput_rx_kib_x1024_median"] = round(statistics.median(numbers))
        out["throughput_over_copied"] = round(statistics.median(numbers) / copied_rate, 3)
    else:
        out["throughput_rx"] = sampled[:1]
    return out


def _guarded(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # one failing measurement must not lose the others
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document (default: the same, indented)")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of the host-to-device copy run")
    args = ap.parse_args()
    try:
        import pynvml as nv

        nv.nvmlInit()
    except Exception as exc:
        print(json.dumps({"error": f"NVML does not initialise: {exc}"}))
        return 2
    from gpupool_sdk.inventory.nvml import NvmlBackend

    doc: dict[str, Any] = {"driver": nv.nvmlSystemGetDriverVersion(), "devices": []}
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        fields: dict[str, Any]
        try:
            fields = {n: r for n, (r, _, _) in _counters(nv, h).items()}
        except nv.NVMLError as exc:
            fields = {"error": str(exc)}
        ids = [(nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0), (nv.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0)]
        doc["devices"].append({
            "index": i,
            "name": str(nv.nvmlDeviceGetName(h)),
            "fields": fields,
            "call_us": {
                "utilization": _median_us(lambda h=h: nv.nvmlDeviceGetUtilizationRates(h)),
                "memory_info": _median_us(lambda h=h: nv.nvmlDeviceGetMemoryInfo(h)),
                "field_values_pcie": _median_us(lambda h=h, ids=ids: nv.nvmlDeviceGetFieldValues(h, ids)),
                "pcie_throughput_tx": _median_us(lambda h=h: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES), n=5),
            },
            "h2d": _guarded(_h2d, nv, h, args.seconds) if i == 0 else {"skipped": "only GPU 0 is loaded"},
        })
    backend = NvmlBackend()
    try:
        backend.gpus()
        doc["refresh_us"] = _median_us(backend.gpus, n=5)
        doc["gpus"] = [g.to_dict() for g in backend.gpus()]
        doc["readings"] = {u: r.to_dict() for u, r in backend.readings().items()}
    finally:
        backend.close()
    print(json.dumps(doc, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
