"""Load job traces in the unified schema of ``../shared/traces/README.md``.

The schema is one CSV with a header row::

    job_id,source,submit_s,start_s,end_s,duration_s,num_gpu,gpu_fraction,priority,status,extra

Only ``job_id``, ``submit_s`` and ``num_gpu`` are required columns; the others may be absent or
empty. Every row is validated and an error names the file, the row (its line number, the header
being line 1), the column, and what to write instead.

How a row's run time is found, in this order (``TraceJob.duration_origin`` records which):

1. ``duration_s`` when present (``"trace"``);
2. ``end_s - start_s`` when both are present (``"trace"``);
3. the ``application`` named in ``extra`` (Pollux/Sia workloads) looked up in
   :data:`APPLICATION_GPU_HOURS`, divided by the GPUs asked for (``"application"``);
4. a draw from the Tiresias YARN GPU-time samples with a seeded RNG (``"sampled"``).

``extra`` keys the loader reads (others are kept as text in ``TraceJob.extra``):

* ``application=NAME``: the run time, as above;
* ``min_gpu=N`` and ``max_gpu=M``: the row is an elastic job that may run on ``N`` to ``M`` GPUs
  (whole numbers, ``1 <= min_gpu <= num_gpu <= max_gpu``; a missing one defaults to ``num_gpu``).
  Only the ``gpupool`` policy uses them (the baselines run every job on ``num_gpu`` GPUs); see
  :mod:`gpupool_sdk.sim.engine` for the speed of a job on another GPU count. A row of an
  :data:`ADAPTIVE_APPLICATIONS` application without its own bounds is elastic from ``num_gpu`` to
  ``ADAPTIVE_MAX_FACTOR x num_gpu`` (``adaptive_applications=False``: rigid), a statement about
  the workload (the Pollux/Sia jobs adapt their GPU count), not a policy setting;
* ``checkpoint_s=``, ``restart_s=`` (the job's preemption cost) and the memory keys
  (``gpu_mem_gib=``...) are read by the engine and the workload model.

Rows asking for 0 GPUs (CPU-only pods) are skipped and counted. Rows whose ``status`` is
``Running`` were still running when the trace ended: their duration is a lower bound
(right-censored); they are kept by default (``censored="keep"``) and counted, or dropped.
"""

from __future__ import annotations

import csv
import fnmatch
import math
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpupool_sdk.errors import ConfigError

#: Columns of the unified schema, in the order the README lists them.
SCHEMA_COLUMNS: tuple[str, ...] = (
    "job_id",
    "source",
    "submit_s",
    "start_s",
    "end_s",
    "duration_s",
    "num_gpu",
    "gpu_fraction",
    "priority",
    "status",
    "extra",
)
REQUIRED_COLUMNS: tuple[str, ...] = ("job_id", "submit_s", "num_gpu")

#: Statuses meaning "still running when the trace ended" (the duration is a lower bound).
CENSORED_STATUSES = frozenset({"running"})

#: GPU-hours of one job of each Pollux/Sia application (total work, at any GPU count). The
#: workload files give only the application; Pollux (OSDI'21, Table 1) sizes them as Small
#: (0-1 GPU-hours: cifar10/ResNet18, ncf/NeuMF), Medium (1-10: deepspeech2, bert fine-tuning),
#: Large (10-100: yolov3) and XLarge (100-1000: imagenet/ResNet-50). We take a representative
#: value inside each band; run time = GPU-hours * 3600 / num_gpu (linear scaling assumed).
APPLICATION_GPU_HOURS: Mapping[str, float] = {
    "cifar10": 0.5,
    "ncf": 0.25,
    "deepspeech2": 3.0,
    "bert": 2.0,
    "yolov3": 25.0,
    "imagenet": 150.0,
}

#: Applications whose jobs are adaptive: in the Pollux (OSDI'21) and Sia (SOSP'23) artifacts
#: every job of these applications adapts its batch size and GPU count while it runs; the
#: ``num_gpu`` of a workload row is only what rigid baselines give it (Pollux's artifact picks it
#: where the job's measured scaling efficiency is 50-80 %), and a job scales up to its largest
#: batch over its smallest per-GPU batch (cifar10: 2,048 / 32 = 64 GPUs).
ADAPTIVE_APPLICATIONS: frozenset[str] = frozenset(APPLICATION_GPU_HOURS)

#: How far an adaptive application's job may grow past the GPUs its row asks for
#: (``max_gpu = ADAPTIVE_MAX_FACTOR x num_gpu``; the cluster caps it further). It never goes
#: below what it asks (``min_gpu = num_gpu``): Pollux's jobs could also run on fewer, but the
#: rows ask ``num_gpu`` and a job started below its ask is slower than one that waits a little
#: (``docs/simulation.md`` section 5b measures both).
ADAPTIVE_MAX_FACTOR = 4

TRACES_DIR_ENV = "GPUPOOL_TRACES_DIR"


class TraceError(ConfigError):
    """A trace file is missing, has a bad header, or a malformed row (the message names row and column)."""


def parse_application_hours(pairs: Sequence[str]) -> dict[str, float]:
    """The application table for :func:`load_trace`: :data:`APPLICATION_GPU_HOURS` plus
    ``NAME=GPU_HOURS`` pairs (a pair for a known name replaces its value).

    Raises:
        ConfigError: a pair without ``=`` or a name, or hours that are not a positive number.

    Example:
        >>> parse_application_hours(["gpt2=12", "bert=4"])["gpt2"], parse_application_hours(["bert=4"])["bert"]
        (12.0, 4.0)
    """
    out = dict(APPLICATION_GPU_HOURS)
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip()
        try:
            hours = float(value) if sep and name else math.nan
        except ValueError:
            hours = math.nan
        if not (math.isfinite(hours) and hours > 0):
            raise ConfigError(
                "application_gpu_hours", f"expected NAME=GPU_HOURS with hours > 0 (e.g. gpt2=12), got {pair!r}"
            )
        out[name] = hours
    return out


def default_traces_dir() -> Path:
    """``$GPUPOOL_TRACES_DIR`` if set, else ``../shared/traces`` relative to the repository root."""
    env = os.environ.get(TRACES_DIR_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def resolve_trace_path(path: str | os.PathLike[str]) -> Path:
    """Find a trace: the path as given, else the same name under :func:`default_traces_dir`.

    Raises:
        TraceError: neither exists.
    """
    p = Path(path)
    if p.is_file():
        return p
    alt = default_traces_dir() / p
    if not p.is_absolute() and alt.is_file():
        return alt
    raise TraceError(
        "trace",
        f"no file {str(p)!r} (also looked in {str(default_traces_dir())!r}); give a CSV path in the "
        f"unified schema, or set ${TRACES_DIR_ENV}",
    )


@dataclass(frozen=True)
class TraceJob:
    """One job of a trace, normalised.

    Attributes:
        index: position in the loaded trace after sorting by arrival (also the simulator's job name ``j<index>``).
        job_id: the trace's id (unique per ``source``).
        source: the sub-trace the row came from.
        submit_s: arrival time in simulated seconds (after ``time_scale``).
        duration_s: run time alone on the resources asked for.
        num_gpu: GPUs asked for (>= 1).
        gpu_fraction: share of one GPU for a single-GPU job, in (0, 1].
        priority: the trace's QoS/priority class (``"LS"``, ``"BE"``...; empty when absent).
        status: the final state in the trace, where known.
        extra: the ``key=value`` details.
        censored: True when the row was still running at trace end (duration is a lower bound).
        duration_origin: ``"trace"``, ``"application"`` or ``"sampled"``.
        row: line number in the file (header = 1).
        min_gpu: fewest GPUs the job may run on (``min_gpu=`` in ``extra``), None when not given.
        max_gpu: most GPUs the job may use (``max_gpu=`` in ``extra``), None when not given.
    """

    index: int
    job_id: str
    source: str
    submit_s: float
    duration_s: float
    num_gpu: int
    gpu_fraction: float
    priority: str = ""
    status: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)
    censored: bool = False
    duration_origin: str = "trace"
    row: int = 0
    min_gpu: int | None = None
    max_gpu: int | None = None

    @property
    def is_elastic(self) -> bool:
        """True when the row declares GPU bounds other than ``num_gpu`` (``min_gpu=`` / ``max_gpu=``)."""
        return (self.min_gpu or self.num_gpu) != self.num_gpu or (self.max_gpu or self.num_gpu) != self.num_gpu

    @property
    def name(self) -> str:
        """The simulator's job name (a valid :class:`~gpupool_sdk.resources.JobSpec` name)."""
        return f"j{self.index}"

    @property
    def gpu_demand(self) -> float:
        """GPUs' worth of compute asked for (``num_gpu * gpu_fraction``)."""
        return self.num_gpu * self.gpu_fraction


@dataclass(frozen=True)
class TraceStats:
    """What the loader did with the rows of a file."""

    rows: int = 0
    jobs: int = 0
    skipped_cpu_only: int = 0
    censored: int = 0
    dropped_censored: int = 0
    dropped_by_filter: int = 0
    durations_from_trace: int = 0
    durations_from_application: int = 0
    durations_sampled: int = 0
    elastic: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Trace:
    """A loaded trace: jobs sorted by arrival plus what the loader counted."""

    path: str
    jobs: tuple[TraceJob, ...]
    stats: TraceStats

    def __len__(self) -> int:
        return len(self.jobs)


def load_duration_samples(path: str | os.PathLike[str] | None = None) -> list[float]:
    """Read the Tiresias YARN GPU-time samples (one ``duration`` column, seconds).

    Args:
        path: the CSV; default ``tiresias_yarn_gpu_time_samples.csv`` in :func:`default_traces_dir`.

    Raises:
        TraceError: the file is missing or a row is not a positive number.
    """
    p = Path(path) if path is not None else default_traces_dir() / "tiresias_yarn_gpu_time_samples.csv"
    if not p.is_file():
        raise TraceError("duration_samples", f"no file {str(p)!r}; pass the Tiresias GPU-time samples CSV")
    out: list[float] = []
    with p.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise TraceError("duration_samples", f"{p}: empty file")
        for lineno, row in enumerate(reader, start=2):
            if not row or not row[0].strip():
                continue
            try:
                v = float(row[0])
            except ValueError:
                raise TraceError(
                    "duration_samples", f"{p} row {lineno}: {row[0]!r} is not a number of seconds"
                ) from None
            if not v > 0 or not math.isfinite(v):
                raise TraceError("duration_samples", f"{p} row {lineno}: duration must be > 0, got {v}")
            out.append(v)
    if not out:
        raise TraceError("duration_samples", f"{p}: no samples")
    return out


def parse_extra(text: str) -> dict[str, str]:
    """Parse ``key=value;key=value`` (empty values allowed, stray separators ignored)."""
    out: dict[str, str] = {}
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{part!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


class _RowReader:
    def __init__(self, path: Path, lineno: int, row: Mapping[str, str | None]) -> None:
        self.path = path
        self.lineno = lineno
        self.row = row

    def fail(self, column: str, message: str) -> TraceError:
        return TraceError("trace", f"{self.path.name} row {self.lineno}, column {column!r}: {message}")

    def text(self, column: str) -> str:
        v = self.row.get(column)
        return "" if v is None else v.strip()

    def number(self, column: str, *, required: bool, minimum: float = 0.0) -> float | None:
        raw = self.text(column)
        if not raw:
            if required:
                raise self.fail(column, "is empty; write a number of seconds/GPUs")
            return None
        try:
            v = float(raw)
        except ValueError:
            raise self.fail(column, f"{raw!r} is not a number") from None
        if not math.isfinite(v) or v < minimum:
            raise self.fail(column, f"must be a finite number >= {minimum:g}, got {raw!r}")
        return v


def _gpu_bounds(r: _RowReader, extra: Mapping[str, str], num_gpu: int) -> tuple[int | None, int | None]:
    """The row's elastic bounds from ``min_gpu=`` / ``max_gpu=`` in ``extra`` (None where absent)."""
    out: list[int | None] = []
    for key in ("min_gpu", "max_gpu"):
        raw = extra.get(key, "")
        if not raw:
            out.append(None)
            continue
        try:
            v = float(raw)
        except ValueError:
            raise r.fail("extra", f"{key}={raw!r} is not a whole number of GPUs") from None
        if not math.isfinite(v) or v != int(v) or v < 1:
            raise r.fail("extra", f"{key}={raw!r} must be a whole number of GPUs >= 1")
        out.append(int(v))
    lo, hi = out
    if lo is not None and lo > num_gpu:
        raise r.fail("extra", f"min_gpu={lo} exceeds num_gpu={num_gpu}; need min_gpu <= num_gpu <= max_gpu")
    if hi is not None and hi < num_gpu:
        raise r.fail("extra", f"max_gpu={hi} is below num_gpu={num_gpu}; need min_gpu <= num_gpu <= max_gpu")
    return lo, hi


def load_trace(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    max_jobs: int | None = None,
    time_scale: float = 1.0,
    censored: str = "keep",
    sources: Sequence[str] = (),
    duration_samples: Sequence[float] | None = None,
    application_gpu_hours: Mapping[str, float] | None = None,
    max_duration_s: float | None = None,
    adaptive_applications: bool = True,
) -> Trace:
    """Load and validate a trace file in the unified schema.

    Args:
        path: the CSV (a bare name is also looked up in :func:`default_traces_dir`).
        seed: seeds the draws of missing durations (same seed, same trace).
        max_jobs: keep only the first N GPU jobs by arrival (after the ``sources`` filter).
        time_scale: multiply arrival times by this (``0.01`` compresses arrivals 100x, making a
            long trace congested on a small cluster); durations are not scaled.
        censored: ``"keep"`` right-censored rows with their observed (lower-bound) duration, or ``"drop"``.
        sources: keep only rows whose ``source`` matches one of these shell-style patterns
            (``"sia_philly_workload-1"`` exactly, ``"sia_saturn_*"`` a family; empty = all).
        duration_samples: GPU-time samples to draw missing durations from (default: the Tiresias
            YARN samples, read only if some row needs one).
        application_gpu_hours: overrides :data:`APPLICATION_GPU_HOURS`.
        max_duration_s: clip durations to this (None = no clip); clipped rows count as censored.
        adaptive_applications: rows of an :data:`ADAPTIVE_APPLICATIONS` application without
            their own ``min_gpu=`` / ``max_gpu=`` are elastic from ``num_gpu`` to
            ``ADAPTIVE_MAX_FACTOR x num_gpu`` GPUs (False: they run on ``num_gpu``, rigid).

    Returns:
        The :class:`Trace`, jobs sorted by (arrival, row).

    Raises:
        TraceError: missing file, bad header or a malformed row (the message names row and column).

    Example:
        >>> trace = load_trace("tiresias_60job.csv")  # doctest: +SKIP
        >>> len(trace), trace.jobs[0].duration_s  # doctest: +SKIP
        (60, 164.0)
    """
    if not time_scale > 0:
        raise TraceError("time_scale", f"must be > 0 (0.01 compresses arrivals 100x), got {time_scale}")
    if censored not in ("keep", "drop"):
        raise TraceError("censored", f"use 'keep' or 'drop', got {censored!r}")
    if max_jobs is not None and max_jobs < 1:
        raise TraceError("max_jobs", f"must be >= 1, got {max_jobs}")
    if max_duration_s is not None and not max_duration_s > 0:
        raise TraceError("max_duration_s", f"must be > 0, got {max_duration_s}")
    p = resolve_trace_path(path)
    apps = dict(APPLICATION_GPU_HOURS if application_gpu_hours is None else application_gpu_hours)
    rng = random.Random(seed)
    samples: Sequence[float] | None = duration_samples

    raw_jobs: list[tuple[float, int, dict[str, object]]] = []
    counts = dict(
        rows=0, skipped_cpu_only=0, censored=0, dropped_censored=0, dropped_by_filter=0,
    )
    seen: dict[tuple[str, str], int] = {}
    # utf-8-sig: a file saved by a spreadsheet starts with a byte-order mark, which would
    # otherwise become part of the first column's name.
    with p.open(newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        header = [h.strip() for h in (reader.fieldnames or [])]
        if not header:
            raise TraceError("trace", f"{p.name}: empty file; expected a header row {','.join(SCHEMA_COLUMNS)}")
        reader.fieldnames = header
        missing = [c for c in REQUIRED_COLUMNS if c not in header]
        if missing:
            raise TraceError(
                "trace",
                f"{p.name} row 1 (header): missing column(s) {missing}; the unified schema is "
                f"{','.join(SCHEMA_COLUMNS)}",
            )
        for lineno, row in enumerate(reader, start=2):
            if all(not (v or "").strip() for k, v in row.items() if k is not None):
                continue  # blank line
            counts["rows"] += 1
            r = _RowReader(p, lineno, row)
            if None in row:
                raise r.fail("extra", f"row has more fields than the header ({len(header)}); quote commas in extra")
            job_id = r.text("job_id")
            if not job_id:
                raise r.fail("job_id", "is empty; every row needs an id unique within its source")
            source = r.text("source")
            if sources and not any(fnmatch.fnmatchcase(source, pat) for pat in sources):
                counts["dropped_by_filter"] += 1
                continue
            key = (source, job_id)
            if key in seen:
                raise r.fail("job_id", f"{job_id!r} repeats row {seen[key]} in source {source!r}; ids must be unique")
            seen[key] = lineno
            submit = r.number("submit_s", required=True)
            assert submit is not None
            num_gpu_f = r.number("num_gpu", required=True)
            assert num_gpu_f is not None
            if num_gpu_f != int(num_gpu_f):
                hint = (
                    f"; for a share of one GPU write num_gpu=1 and gpu_fraction={num_gpu_f:g}"
                    if 0 < num_gpu_f < 1 else ""
                )
                raise r.fail("num_gpu", f"must be a whole number of GPUs, got {r.text('num_gpu')!r}{hint}")
            num_gpu = int(num_gpu_f)
            frac = r.number("gpu_fraction", required=False)
            if num_gpu == 0:
                counts["skipped_cpu_only"] += 1
                continue
            if frac is None:
                frac = 1.0
            if not 0.0 < frac <= 1.0:
                raise r.fail("gpu_fraction", f"must be in (0, 1] for a GPU job, got {r.text('gpu_fraction')!r}")
            if frac < 1.0 and num_gpu > 1:
                raise r.fail("gpu_fraction", f"fractions are for single-GPU jobs; this row asks {num_gpu} GPUs")
            try:
                extra = parse_extra(r.text("extra"))
            except ValueError as exc:
                raise r.fail("extra", f"{exc}; write key=value;key=value") from None
            min_gpu, max_gpu = _gpu_bounds(r, extra, num_gpu)
            if (
                adaptive_applications and min_gpu is None and max_gpu is None and frac == 1.0
                and extra.get("application") in ADAPTIVE_APPLICATIONS
            ):
                max_gpu = ADAPTIVE_MAX_FACTOR * num_gpu
            status = r.text("status")
            is_censored = status.lower() in CENSORED_STATUSES
            start = r.number("start_s", required=False)
            end = r.number("end_s", required=False)
            duration = r.number("duration_s", required=False)
            origin = "trace"
            if duration is None and start is not None and end is not None:
                if end < start:
                    raise r.fail("end_s", f"ends ({end:g}) before it starts ({start:g})")
                duration = end - start
            if duration is None and "application" in extra:
                app = extra["application"]
                if app not in apps:
                    raise r.fail(
                        "extra",
                        f"application {app!r} has no known duration; add duration_s to the row, give its GPU-hours "
                        f"(gpupool simulate --application-hours {app}=GPU_HOURS), or use one of {sorted(apps)}",
                    )
                duration = apps[app] * 3600.0 / num_gpu
                origin = "application"
            if duration is None:
                if samples is None:
                    samples = load_duration_samples()
                duration = rng.choice(samples)
                origin = "sampled"
                is_censored = False  # the draw replaces the unknown run time
            if duration <= 0:
                duration = 1.0  # a pod that ended in the second it started still occupied its GPU
            if max_duration_s is not None and duration > max_duration_s:
                duration = max_duration_s
                is_censored = True
            if is_censored:
                counts["censored"] += 1
                if censored == "drop":
                    counts["dropped_censored"] += 1
                    continue
            raw_jobs.append(
                (
                    submit * time_scale,
                    lineno,
                    dict(
                        job_id=job_id, source=source, duration_s=float(duration), num_gpu=num_gpu,
                        gpu_fraction=float(frac), priority=r.text("priority"), status=status, extra=extra,
                        censored=is_censored, duration_origin=origin, row=lineno, min_gpu=min_gpu, max_gpu=max_gpu,
                    ),
                )
            )
    raw_jobs.sort(key=lambda t: (t[0], t[1]))
    if max_jobs is not None:
        raw_jobs = raw_jobs[:max_jobs]
    if not raw_jobs:
        raise TraceError("trace", f"{p.name}: no GPU job left to simulate (rows={counts['rows']}, filters too strict?)")
    t0 = raw_jobs[0][0]
    jobs = tuple(
        TraceJob(index=i, submit_s=submit - t0, **fields)  # type: ignore[arg-type]
        for i, (submit, _, fields) in enumerate(raw_jobs)
    )
    kept_censored = sum(1 for j in jobs if j.censored)
    stats = TraceStats(
        rows=counts["rows"],
        jobs=len(jobs),
        skipped_cpu_only=counts["skipped_cpu_only"],
        censored=kept_censored + counts["dropped_censored"],
        dropped_censored=counts["dropped_censored"],
        dropped_by_filter=counts["dropped_by_filter"],
        durations_from_trace=sum(1 for j in jobs if j.duration_origin == "trace"),
        durations_from_application=sum(1 for j in jobs if j.duration_origin == "application"),
        durations_sampled=sum(1 for j in jobs if j.duration_origin == "sampled"),
        elastic=sum(1 for j in jobs if j.is_elastic),
    )
    return Trace(path=str(p), jobs=jobs, stats=stats)
