"""The out-of-memory risk the overcommit predictor takes, measured on peaks from the shared traces.

Shared jobs are packed onto GPUs by the scheduler's own capacity rule (``filter.request_for`` and
``filter.fits``: quotas within ``overcommit_ratio x physical``, predicted peaks within physical
memory), with their peak predicted by ``filter.predicted_peak`` under two configurations:

* **single-peak**: the latest window's peak x (1 + ``peak_margin``) (``peak_history_min=0``);
* **history**: a percentile of the job's recent window peaks plus ``peak_history_margin``.

Then the packed jobs run: every window each job reaches a peak drawn from its own behaviour, and
a GPU whose jobs' peaks add up to more than its memory in a window is one **out-of-memory
event**. **Memory used** is the memory the jobs actually occupy, over all GPUs and windows, as a
fraction of the memory there is (capped at each GPU's memory).

The workload (stated, not hidden):

* a job's largest peak is a measured one: ``gmem`` of a Lucid single-job profile
  (``lucid_single_jobs.csv``: 66 models x batch sizes x AMP, 2-40 GB), drawn at random;
* its quota is that peak x ``quota_headroom`` (default 1.25), rounded up to a GiB;
* a window reaches the largest peak with probability ``p_full`` (drawn per job in
  ``p_full_range``: windows that contain a validation pass, the longest sequences, the optimizer
  step); otherwise it reaches ``peak x (1 - dip x u)`` with ``u`` uniform in [0, 1] and ``dip``
  drawn per job in ``dip_range``. These two ranges are assumptions of this model, not trace
  data: the traces give one peak per job, not a time series. :func:`sweep` varies them.
* each job arrives with ``history`` windows already observed (it ran before being packed).

Run ``python -m gpupool_sdk.sim.overcommit`` for the table in ``docs/simulation.md``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpupool_sdk.resources import JobSpec
from gpupool_sdk.scheduler.filter import GpuLoad, fits, request_for
from gpupool_sdk.scheduler.types import JobView, SchedulerConfig

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


@dataclass(frozen=True)
class MemoryJob:
    """One shared job's memory behaviour.

    Attributes:
        name: job name.
        peak: its largest per-window peak in bytes.
        quota: the memory it declares per slice.
        p_full: probability that a window reaches ``peak``.
        dip: how far below ``peak`` a window that misses it may stay (fraction).
    """

    name: str
    peak: int
    quota: int
    p_full: float
    dip: float

    def window(self, rng: random.Random) -> int:
        """This job's peak in one window."""
        if rng.random() < self.p_full:
            return self.peak
        return int(self.peak * (1.0 - self.dip * rng.random()))


@dataclass(frozen=True)
class Workload:
    """How the jobs are drawn (see the module docstring)."""

    gpus: int = 32
    gpu_memory: int = 80 * GiB
    jobs: int = 1200
    history: int = 32
    windows: int = 200
    quota_headroom: float = 1.25
    p_full_range: tuple[float, float] = (0.2, 0.9)
    dip_range: tuple[float, float] = (0.1, 0.5)


@dataclass(frozen=True)
class Outcome:
    """What one packing did over the run.

    Attributes:
        placed: jobs packed.
        oom_events: GPU-windows whose jobs' peaks exceeded the GPU's memory.
        oom_jobs: jobs that saw at least one such window.
        memory_used: memory the jobs occupied / memory there is (0-1), over GPUs and windows.
    """

    placed: int
    oom_events: int
    oom_jobs: int
    memory_used: float


def lucid_peaks(traces: Path = DEFAULT_TRACES) -> list[int]:
    """The measured peaks (bytes) of the Lucid single-job profiles (``gmem`` in MiB)."""
    with (traces / "lucid_single_jobs.csv").open() as fh:
        return [int(float(row["gmem"]) * MiB) for row in csv.DictReader(fh) if float(row["gmem"] or 0) > 0]


def draw_jobs(peaks: Sequence[int], wl: Workload, rng: random.Random) -> list[MemoryJob]:
    """``wl.jobs`` jobs with peaks drawn from ``peaks`` (only those that fit one GPU)."""
    usable = [p for p in peaks if p * wl.quota_headroom <= wl.gpu_memory]
    out = []
    for i in range(wl.jobs):
        peak = rng.choice(usable)
        quota = math.ceil(peak * wl.quota_headroom / GiB) * GiB
        out.append(MemoryJob(f"job-{i}", peak, min(quota, wl.gpu_memory), rng.uniform(*wl.p_full_range),
                             rng.uniform(*wl.dip_range)))
    return out


def pack(jobs: Sequence[MemoryJob], histories: Sequence[Sequence[int]], wl: Workload,
         config: SchedulerConfig) -> list[list[int]]:
    """Jobs (indexes) on each GPU, first fit in arrival order, by the scheduler's capacity rule."""
    loads = [GpuLoad(phys=wl.gpu_memory) for _ in range(wl.gpus)]
    placed: list[list[int]] = [[] for _ in range(wl.gpus)]
    for i, (job, hist) in enumerate(zip(jobs, histories, strict=True)):
        spec = JobSpec(name=job.name, gpus=1, memory=job.quota, qos="shared")
        view = JobView(spec=spec, memory_peak_bytes=hist[-1] if hist else None, memory_peak_history=tuple(hist))
        req = request_for(view, config)
        for g, load in enumerate(loads):
            if fits(load, req, config.overcommit_ratio):
                load.add(req.qos, req.memory, req.compute, req.peak)
                placed[g].append(i)
                break
    return placed


def run_once(jobs: Sequence[MemoryJob], wl: Workload, config: SchedulerConfig, seed: int,
             histories: Sequence[Sequence[int]] | None = None) -> Outcome:
    """Pack ``jobs`` under ``config`` and run them for ``wl.windows`` windows.

    ``histories``: the window peaks each job arrives with (default: ``wl.history`` drawn ones).
    """
    rng = random.Random(seed)
    if histories is None:
        histories = [[j.window(rng) for _ in range(wl.history)] for j in jobs]
    placed = pack(jobs, histories, wl, config)
    run_rng = random.Random(seed + 1)  # the same future for every configuration
    futures = [[j.window(run_rng) for _ in range(wl.windows)] for j in jobs]
    events = 0
    used = 0
    hit: set[int] = set()
    for members in placed:
        for w in range(wl.windows):
            total = sum(futures[i][w] for i in members)
            if total > wl.gpu_memory:
                events += 1
                hit.update(members)
            used += min(total, wl.gpu_memory)
    return Outcome(placed=sum(len(m) for m in placed), oom_events=events, oom_jobs=len(hit),
                   memory_used=used / (wl.gpu_memory * wl.gpus * wl.windows))


#: Margins tried for the single-peak rule when it is matched to the history rule's OOM events.
SINGLE_PEAK_MARGINS = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


def totals(config: SchedulerConfig, wl: Workload, seeds: Sequence[int], peaks: Sequence[int]) -> dict[str, float]:
    """Placed jobs, OOM events and jobs summed over ``seeds``; memory used averaged over them."""
    acc = {"placed": 0.0, "oom_events": 0.0, "oom_jobs": 0.0, "memory_used": 0.0}
    for seed in seeds:
        jobs = draw_jobs(peaks, wl, random.Random(seed))
        out = run_once(jobs, wl, config, seed)
        acc["placed"] += out.placed
        acc["oom_events"] += out.oom_events
        acc["oom_jobs"] += out.oom_jobs
        acc["memory_used"] += out.memory_used / len(seeds)
    return acc


def compare(config: SchedulerConfig, wl: Workload, seeds: Sequence[int], peaks: Sequence[int],
            matched: bool = True) -> dict[str, Any]:
    """``config``'s history rule against the single-peak rule, on the same jobs and futures.

    Two baselines: the single-peak rule with ``config.peak_margin`` (today's rule), and, with
    ``matched``, the single-peak rule with the smallest margin of :data:`SINGLE_PEAK_MARGINS`
    that has no more OOM events than the history rule (the comparison at equal risk).
    """
    single = dataclasses.replace(config, peak_history_min=0)
    s = totals(single, wl, seeds, peaks)
    h = totals(config, wl, seeds, peaks)
    out: dict[str, Any] = {
        "single_peak": s,
        "history": h,
        "memory_used_gain": h["memory_used"] / s["memory_used"] - 1.0 if s["memory_used"] else 0.0,
        "no_more_ooms": h["oom_events"] <= s["oom_events"],
    }
    if matched:
        for margin in SINGLE_PEAK_MARGINS:
            m = s if margin == config.peak_margin else totals(
                dataclasses.replace(single, peak_margin=margin), wl, seeds, peaks)
            if m["oom_events"] <= h["oom_events"]:
                out["single_peak_matched"] = {"peak_margin": margin, **m}
                out["matched_gain"] = h["memory_used"] / m["memory_used"] - 1.0 if m["memory_used"] else 0.0
                break
    return out


def sweep(wl: Workload, seeds: Sequence[int], peaks: Sequence[int], base: SchedulerConfig | None = None,
          percentiles: Sequence[float] = (0.9, 0.95, 1.0), margins: Sequence[float] = (0.0, 0.02, 0.05, 0.1)
          ) -> list[dict[str, Any]]:
    """:func:`compare` for each history rule (percentile x margin)."""
    base = base or SchedulerConfig(overcommit_ratio=1.5)
    rows = []
    for q in percentiles:
        for m in margins:
            cfg = dataclasses.replace(base, peak_percentile=q, peak_history_margin=m)
            rows.append({"peak_percentile": q, "peak_history_margin": m,
                         **compare(cfg, wl, seeds, peaks, matched=False)})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gpupool_sdk.sim.overcommit [--traces DIR] [--seeds N] [--json]``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER

    peaks = lucid_peaks(args.traces)
    seeds = list(range(args.seeds))
    report: dict[str, Any] = {"default": compare(DEFAULT_SCHEDULER, Workload(), seeds, peaks)}
    report["sweep"] = sweep(Workload(), seeds, peaks, base=DEFAULT_SCHEDULER)
    report["sensitivity"] = []
    for p_full in ((0.9, 1.0), (0.5, 0.9), (0.2, 0.9), (0.05, 0.3)):
        for dip in ((0.02, 0.1), (0.1, 0.5)):
            wl = dataclasses.replace(Workload(), p_full_range=p_full, dip_range=dip)
            report["sensitivity"].append({"p_full_range": p_full, "dip_range": dip,
                                          **compare(DEFAULT_SCHEDULER, wl, seeds, peaks)})
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    def line(r: dict[str, Any]) -> str:
        s, h = r["single_peak"], r["history"]
        text = (f"memory used {s['memory_used']:.3f} -> {h['memory_used']:.3f} ({r['memory_used_gain']:+.1%}); "
                f"OOM events {int(s['oom_events'])} -> {int(h['oom_events'])}; OOM jobs {int(s['oom_jobs'])} -> "
                f"{int(h['oom_jobs'])}; placed {int(s['placed'])} -> {int(h['placed'])}")
        m = r.get("single_peak_matched")
        if m is not None:
            text += (f" | single-peak at equal risk (margin {m['peak_margin']}): memory used {m['memory_used']:.3f}, "
                     f"OOM events {int(m['oom_events'])}, placed {int(m['placed'])}; history {r['matched_gain']:+.1%}")
        elif "single_peak_matched" not in r and r.get("history") is not None and "matched_gain" in r:
            pass
        return text
    print("default:", line(report["default"]))
    for r in report["sweep"]:
        print(f"q={r['peak_percentile']:.2f} margin={r['peak_history_margin']:.2f}:", line(r))
    for r in report["sensitivity"]:
        print(f"p_full={r['p_full_range']} dip={r['dip_range']}:", line(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
