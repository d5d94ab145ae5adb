"""The workload model: per-job memory demand and utilization profile, colocation slowdown.

Profiles come from Lucid's 66 single-job measurements (``lucid_single_jobs.csv``: model,
batch size, AMP, GPU utilization, GPU memory, and Lucid's interference class ``label`` 0/1/2 =
light/medium/heavy). Each simulated job draws one profile with a seeded RNG keyed by the job,
so every policy of one run sees the same workload.

Colocation slowdown (documented in ``docs/simulation.md``): a **class-based** model fitted
from Lucid's 1,388 measured pairs (``lucid_colocation_pairs.csv``). Each side of a pair is
matched to its single-job profile by (model, batch size, AMP) to get its class; the speed of a
class-``a`` job sharing a GPU with a class-``b`` job is the mean normalised speed over the
matching pairs, ``S[a][b]``. A job sharing a GPU with several others runs at the product of
the pairwise factors; a multi-GPU (gang) job runs at the speed of its slowest GPU.
"""

from __future__ import annotations

import csv
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpupool_sdk.resources.units import MiB
from gpupool_sdk.sim.trace import TraceError, TraceJob, default_traces_dir

#: ``extra`` keys read as the job's GPU memory demand per GPU, in MiB (first found wins).
MEMORY_KEYS_MIB: tuple[str, ...] = ("gpu_mem_mib", "gmem_mib", "gpu_memory_mib", "gmem")
#: ``extra`` keys read as the job's GPU memory demand per GPU, in GiB.
MEMORY_KEYS_GIB: tuple[str, ...] = ("gpu_mem_gib", "gmem_gib")

#: Fallback pairwise speed matrix (row = this job's class, column = partner's class), used when
#: the Lucid pairs file is unavailable. Values fitted from ``lucid_colocation_pairs.csv``.
DEFAULT_SLOWDOWN: tuple[tuple[float, ...], ...] = (
    (0.980, 0.977, 0.950),
    (0.951, 0.914, 0.825),
    (0.938, 0.879, 0.753),
)
MIN_SPEED = 0.05


@dataclass(frozen=True)
class Profile:
    """A single-job profile: what the job keeps busy and how much memory it holds.

    Attributes:
        name: ``model/dataset/batch/amp`` of the measured job.
        gpu_util: fraction of the GPU's compute it keeps busy alone (0-1; idle phases included).
        memory_mib: GPU memory it holds (MiB).
        label: Lucid interference class: 0 light, 1 medium, 2 heavy.
    """

    name: str
    gpu_util: float
    memory_mib: float
    label: int


DEFAULT_PROFILE = Profile("default", 0.6, 8192.0, 1)


def _traces_file(path: str | os.PathLike[str] | None, name: str) -> Path:
    return Path(path) if path is not None else default_traces_dir() / name


def load_profiles(path: str | os.PathLike[str] | None = None) -> list[Profile]:
    """Read Lucid's single-job profiles.

    Raises:
        TraceError: the file is missing or a row is malformed (row number and column named).
    """
    p = _traces_file(path, "lucid_single_jobs.csv")
    if not p.is_file():
        raise TraceError("profiles", f"no file {str(p)!r}; pass Lucid's lucid_single_jobs.csv, or set "
                         "$GPUPOOL_TRACES_DIR to the folder that holds the traces")
    out: list[Profile] = []
    with p.open(newline="") as fh:
        for lineno, row in enumerate(csv.DictReader(fh), start=2):
            try:
                out.append(
                    Profile(
                        name=f"{row['model']}/{row['dataset']}/{row['batchsize']}/{row['amp']}",
                        gpu_util=min(1.0, max(0.01, float(row["gpu_util"]) / 100.0)),
                        memory_mib=float(row["gmem"]),
                        label=int(row["label"]),
                    )
                )
            except (KeyError, ValueError) as exc:
                raise TraceError("profiles", f"{p.name} row {lineno}: {exc!r}") from None
    if not out:
        raise TraceError("profiles", f"{p.name}: no profiles")
    return out


def fit_slowdown(
    profiles: Sequence[Profile] | None = None, pairs_path: str | os.PathLike[str] | None = None
) -> tuple[tuple[float, ...], ...]:
    """Fit the 3x3 class speed matrix ``S[a][b]`` from Lucid's colocation pairs.

    Returns :data:`DEFAULT_SLOWDOWN` cells for class pairs the file never measured.
    """
    p = _traces_file(pairs_path, "lucid_colocation_pairs.csv")
    profs = profiles if profiles is not None else load_profiles()
    label_of: dict[tuple[str, str, str], int] = {}
    for pr in profs:
        model, _dataset, batch, amp = pr.name.split("/")
        label_of[(model, batch, amp)] = pr.label
    sums = [[0.0] * 3 for _ in range(3)]
    counts = [[0] * 3 for _ in range(3)]
    with p.open(newline="") as fh:
        for lineno, row in enumerate(csv.DictReader(fh), start=2):
            try:
                k1 = (row["model1"], row["batchsize1"], row["amp1"])
                k2 = (row["model2"], row["batchsize2"], row["amp2"])
                s1, s2 = float(row["speed1"]), float(row["speed2"])
            except (KeyError, ValueError) as exc:
                raise TraceError("colocation_pairs", f"{p.name} row {lineno}: {exc!r}") from None
            a, b = label_of.get(k1), label_of.get(k2)
            if a is None or b is None:
                continue
            sums[a][b] += min(s1, 1.0)
            counts[a][b] += 1
            sums[b][a] += min(s2, 1.0)
            counts[b][a] += 1
    return tuple(
        tuple(round(sums[a][b] / counts[a][b], 3) if counts[a][b] else DEFAULT_SLOWDOWN[a][b] for b in range(3))
        for a in range(3)
    )


class WorkloadModel:
    """Per-job memory demand, utilization profile and colocation speed.

    Args:
        profiles: Lucid single-job profiles to draw from (default: read from the traces folder).
        slowdown: the class speed matrix (default: fitted from the Lucid pairs).
        seed: seeds the per-job profile draws.

    Example:
        >>> model = WorkloadModel(profiles=[DEFAULT_PROFILE], slowdown=DEFAULT_SLOWDOWN)
        >>> model.colocated_speed(1, [1])
        0.914
    """

    def __init__(
        self,
        profiles: Sequence[Profile] | None = None,
        slowdown: Sequence[Sequence[float]] | None = None,
        seed: int = 0,
    ) -> None:
        self.profiles = list(profiles) if profiles is not None else load_profiles()
        if not self.profiles:
            raise TraceError("profiles", "need at least one profile")
        matrix = slowdown if slowdown is not None else fit_slowdown(self.profiles)
        if len(matrix) != 3 or any(len(r) != 3 for r in matrix):
            raise TraceError("slowdown", "must be a 3x3 matrix of speeds (classes light/medium/heavy)")
        self.slowdown = tuple(tuple(float(x) for x in r) for r in matrix)
        self.seed = seed

    def profile_for(self, job: TraceJob) -> Profile:
        """The profile of ``job``: a seeded draw, the same for every policy of a run."""
        rng = random.Random(f"{self.seed}:{job.source}:{job.job_id}")
        return rng.choice(self.profiles)

    @staticmethod
    def memory_from_extra(extra: Mapping[str, str]) -> int | None:
        """GPU memory demand per GPU (bytes) if the trace's ``extra`` states it, else None."""
        for key in MEMORY_KEYS_MIB:
            if extra.get(key):
                return int(float(extra[key]) * MiB)
        for key in MEMORY_KEYS_GIB:
            if extra.get(key):
                return int(float(extra[key]) * 1024 * MiB)
        return None

    def memory_demand(self, job: TraceJob, profile: Profile) -> int:
        """GPU memory the job holds per GPU, in bytes: from the trace when given, else its profile."""
        from_trace = self.memory_from_extra(job.extra)
        return from_trace if from_trace is not None else int(profile.memory_mib * MiB)

    def colocated_speed(self, label: int, partner_labels: Sequence[int]) -> float:
        """Speed (relative to alone) of a class-``label`` job sharing a GPU with ``partner_labels``."""
        speed = 1.0
        row = self.slowdown[label]
        for b in partner_labels:
            speed *= row[b]
        return max(MIN_SPEED, speed)
