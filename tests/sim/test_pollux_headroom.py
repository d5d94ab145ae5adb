"""The fluid references of simulation 5b (``benchmarks/pollux_headroom.py``) are what they claim.

The heSRPT split is checked against a brute-force search on small instances without arrivals,
where it is the optimum: no split of the GPUs does better.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gpupool_sdk.sim.trace import TraceJob

ROOT = Path(__file__).resolve().parents[2]


def _module() -> ModuleType:
    name = "pollux_headroom"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "pollux_headroom.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


ph = _module()


def _job(i: int, duration: float, gpus: int = 1, max_gpu: int = 64, submit: float = 0.0) -> TraceJob:
    return TraceJob(
        index=i, job_id=str(i), source="s", submit_s=submit, duration_s=duration, num_gpu=gpus,
        gpu_fraction=1.0, priority="", status="", extra={}, censored=False, duration_origin="trace",
        row=i + 2, max_gpu=max_gpu,
    )


def _two_jobs_best(w1: float, w2: float, gpus: float, sigma: float, steps: int = 2000) -> float:
    """Mean JCT of the best split for two jobs present at 0 (work in single-GPU seconds), found
    by search: the shorter job gets ``k`` GPUs until it ends (either may end first), the other
    the rest, then the survivor all of them."""
    s = ph._speed
    best = float("inf")
    for n in range(steps + 1):
        k = gpus * n / steps
        r1, r2 = s(k, sigma), s(gpus - k, sigma)
        t1 = w1 / r1 if r1 > 0 else float("inf")
        t2 = w2 / r2 if r2 > 0 else float("inf")
        if t1 <= t2:
            c1, c2 = t1, t1 + (w2 - r2 * t1) / s(gpus, sigma)
        else:
            c2, c1 = t2, t2 + (w1 - r1 * t2) / s(gpus, sigma)
        best = min(best, (c1 + c2) / 2)
    return best


@pytest.mark.parametrize(("d1", "d2", "sigma"), [(100.0, 110.0, 0.1), (100.0, 120.0, 0.2), (50.0, 1000.0, 0.5)])
def test_hesrpt_split_matches_the_best_split_without_arrivals(d1: float, d2: float, sigma: float) -> None:
    jobs = [_job(0, d1, max_gpu=8), _job(1, d2, max_gpu=8)]
    gpus = 8.0
    got = ph.fluid(jobs, sigma, lambda left, caps, asks, g: ph.hesrpt_allocation(caps, gpus, sigma))
    best = _two_jobs_best(d1 * ph._speed(1, sigma), d2 * ph._speed(1, sigma), gpus, sigma)
    assert got == pytest.approx(best, rel=2e-3)
    # SRPT (all GPUs to the shorter job first) and an equal split are both worse.
    srpt = statistics.mean([d1 / ph._speed(gpus, sigma), (d1 + d2) / ph._speed(gpus, sigma)])
    equal = ph.fluid(jobs, sigma, lambda left, caps, asks, g: [gpus / len(left)] * len(left))
    assert got < srpt and got < equal


def test_hesrpt_gives_the_shortest_the_most_and_every_job_some() -> None:
    split = ph.hesrpt_allocation((64.0,) * 5, 64.0, 0.05)
    assert sum(split) == pytest.approx(64.0)
    assert all(a > b > 0 for a, b in zip(split, split[1:], strict=False))


def test_hesrpt_respects_floors_and_caps() -> None:
    caps, floors = (8.0, 4.0, 32.0, 16.0), (2.0, 1.0, 8.0, 4.0)
    split = ph.hesrpt_allocation(caps, 40.0, 0.05, floors=floors)
    assert sum(split) == pytest.approx(40.0)
    assert all(f - 1e-9 <= k <= c + 1e-9 for k, f, c in zip(split, floors, caps, strict=True))
    # admission: jobs whose floor does not fit get nothing; the others at least their floor
    held = ph.hesrpt_admitted((8.0, 8.0, 2.0), (4.0, 4.0, 2.0), 6.0, 0.05)
    assert held == pytest.approx([4.0, 0.0, 2.0])


def test_whole_gpus_rounds_within_caps_and_uses_every_gpu() -> None:
    assert ph.whole_gpus([2.6, 1.7, 0.7], (3.0, 8.0, 8.0), 5) == [2.0, 2.0, 1.0]
    assert sum(ph.whole_gpus([10.4, 10.3, 10.3], (11.0, 11.0, 11.0), 31)) == 31


def test_static_greedy_favours_the_long_job() -> None:
    held = ph.greedy_static_allocation([100.0, 10_000.0], (64.0, 64.0), 16, 0.05)
    assert held[1] > held[0] >= 1
