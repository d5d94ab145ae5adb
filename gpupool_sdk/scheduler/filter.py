"""Filter stage: may this GPU take this slice?

Two kinds of checks, both pure:

* static ones that do not depend on what is running (:func:`unschedulable_reason`,
  :func:`matches_static`): health, cordon, drain, features, model, MIG profile (a MIG
  instance takes only jobs that ask for its profile, see :func:`features_match`);
* capacity by QoS class (:func:`fits`) against a :class:`GpuLoad`, the per-GPU accounting the
  ledger keeps.

Capacity rules (see ``docs/scheduler.md``):

* ``exclusive`` needs a GPU with no allocation at all, and holds all of its memory and compute.
* ``guaranteed`` needs ``reserved + shared_quota + memory <= physical`` and
  ``compute + share <= 1.0``, on a GPU nobody holds exclusively. Shared quotas count in full
  (a guaranteed reservation is never overcommitted), which is why shared jobs are ballooned
  down to their predicted peak before a guaranteed job takes their room.
* ``shared`` needs ``shared_quota + memory + reserved <= overcommit_ratio * physical`` and
  ``shared_peak + predicted_peak + reserved <= physical``. Shared slices reserve no compute
  (they are best effort, time-sliced).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from gpupool_sdk.resources import GpuInfo, QoS
from gpupool_sdk.resources.gpu import MIG_INSTANCE_FEATURE, MIG_PROFILE_PREFIX, mig_feature
from gpupool_sdk.resources.units import format_size
from gpupool_sdk.scheduler.peak_history import history_peak
from gpupool_sdk.scheduler.types import JobView, SchedulerConfig

#: tolerance on sums of compute shares (floats added and removed over many cycles).
COMPUTE_EPS = 1e-9


@dataclass(slots=True)
class GpuLoad:
    """What is committed on one GPU (mutable, owned by the ledger).

    Attributes:
        phys: physical memory of the GPU.
        reserved: memory reserved by guaranteed slices, plus all of it when held exclusively.
        compute: compute share reserved by guaranteed and exclusive slices.
        shared_quota: sum of the memory quotas of shared slices.
        shared_peak: sum of the predicted peaks of shared slices.
        exclusive: number of exclusive slices (0 or 1 unless the input was already broken).
        slices: number of slices of any class.
    """

    phys: int
    reserved: int = 0
    compute: float = 0.0
    shared_quota: int = 0
    shared_peak: int = 0
    exclusive: int = 0
    slices: int = 0

    @property
    def free_guaranteed(self) -> int:
        """Memory a guaranteed slice could still reserve (ignoring compute)."""
        if self.exclusive:
            return 0
        return self.phys - self.reserved - self.shared_quota

    def shared_headroom(self, ratio: float) -> float:
        """Quota a shared slice could still be given under the overcommit ratio (ignoring peaks)."""
        if self.exclusive:
            return 0.0
        return ratio * self.phys - self.reserved - self.shared_quota

    def copy(self) -> GpuLoad:
        """An independent copy (for what-if computations)."""
        return GpuLoad(
            self.phys, self.reserved, self.compute, self.shared_quota, self.shared_peak, self.exclusive, self.slices
        )

    def add(self, qos: QoS, memory: int, compute: float, peak: int) -> None:
        """Commit one slice."""
        self.slices += 1
        if qos is QoS.EXCLUSIVE:
            self.exclusive += 1
            self.reserved += self.phys
            self.compute += 1.0
        elif qos is QoS.GUARANTEED:
            self.reserved += memory
            self.compute += compute
        else:
            self.shared_quota += memory
            self.shared_peak += peak

    def remove(self, qos: QoS, memory: int, compute: float, peak: int) -> None:
        """Undo :meth:`add` with the same arguments."""
        self.slices -= 1
        if qos is QoS.EXCLUSIVE:
            self.exclusive -= 1
            self.reserved -= self.phys
            self.compute -= 1.0
        elif qos is QoS.GUARANTEED:
            self.reserved -= memory
            self.compute -= compute
        else:
            self.shared_quota -= memory
            self.shared_peak -= peak
        if self.slices == 0:
            # Reset exactly so float drift never accumulates on an idle GPU.
            self.compute = 0.0


@dataclass(frozen=True)
class SliceRequest:
    """What one pending job needs, per slice and in all (derived from its spec).

    Attributes:
        job: the job name.
        qos: its class.
        memory: quota per slice (for ``exclusive``, the minimum physical memory; 0 = any GPU).
        compute: compute share per slice.
        peak: predicted per-slice peak (shared only; equals ``memory`` otherwise).
        features: features every GPU must offer.
        gpu_model: required model, or None.
        count: slices wanted.
        min_count: fewest slices it accepts (elastic jobs), else ``count``.
        topology: ``pack``, ``spread`` or ``any``.
        anti_affinity: group whose live members' nodes it must avoid.
        nodes: the only nodes it may use (its spec's ``node``, or a gang's member nodes);
            empty = any node.
        per_node: for a multi-node gang, exactly this many slices on each of ``nodes``
            (0 = no per-node split).
        util: the job's measured GPU utilisation 0-1 (``JobView.gpu_util``), None when unknown.
        colocate: colocation-aware placement is on (``SchedulerConfig.colocation_aware``).
    """

    job: str
    qos: QoS
    memory: int
    compute: float
    peak: int
    features: tuple[str, ...] = ()
    gpu_model: str | None = None
    count: int = 1
    min_count: int = 1
    topology: str = "pack"
    anti_affinity: str | None = None
    nodes: tuple[str, ...] = ()
    per_node: int = 0
    util: float | None = None
    colocate: bool = False

    @property
    def shape(self) -> tuple[object, ...]:
        """Everything placement depends on except the job's name (for caching failures)."""
        return (
            self.qos,
            self.memory,
            self.compute,
            self.peak,
            self.features,
            self.gpu_model,
            self.count,
            self.min_count,
            self.topology,
            self.anti_affinity,
            self.nodes,
            self.per_node,
        )


def predicted_peak(view: JobView, quota: int, config: SchedulerConfig) -> int:
    """Predicted per-slice peak of a shared job, capped at its quota.

    With at least ``peak_history_min`` window peaks in ``memory_peak_history``: their
    ``peak_percentile`` plus ``peak_history_margin`` (:func:`~gpupool_sdk.scheduler.peak_history.history_peak`).
    Else its latest observed peak plus ``peak_margin``. Unknown peaks are predicted as the whole
    quota (no overcommit gain, no risk).
    """
    hist = view.memory_peak_history
    if config.peak_history_min and len(hist) >= config.peak_history_min:
        return min(quota, history_peak(hist, config.peak_percentile, config.peak_history_margin))
    if view.memory_peak_bytes is None or view.memory_peak_bytes <= 0:
        return quota
    return min(quota, int(view.memory_peak_bytes * (1.0 + config.peak_margin)))


def request_for(view: JobView, config: SchedulerConfig, count: int | None = None) -> SliceRequest:
    """Build the :class:`SliceRequest` of a job (``count`` overrides the spec's slice count)."""
    spec = view.spec
    qos = spec.qos_class
    memory = spec.memory_bytes
    nodes: tuple[str, ...] = ()
    per_node = 0
    if spec.is_gang:
        nodes = tuple(m.node for m in view.members)
        per_node = spec.gpus_per_node
    elif spec.node is not None:
        nodes = (spec.node,)
    peak = predicted_peak(view, memory, config) if qos is QoS.SHARED else memory
    want = spec.gpus if count is None else count
    return SliceRequest(
        job=spec.name,
        qos=qos,
        memory=memory,
        compute=1.0 if qos is QoS.EXCLUSIVE else spec.compute_share,
        peak=peak,
        features=tuple(spec.features) if spec.mig_profile is None else tuple(sorted({*spec.features, mig_feature(spec.mig_profile)})),
        gpu_model=spec.gpu_model,
        count=want,
        min_count=min(spec.min_gpus or want, want),
        topology="pack" if spec.is_gang else spec.topology_wish.value,
        anti_affinity=spec.anti_affinity,
        nodes=nodes,
        per_node=per_node,
        util=view.gpu_util,
        colocate=config.colocation_aware and qos is QoS.SHARED,
    )


def unschedulable_reason(gpu: GpuInfo, cordoned: Collection[str], draining: Collection[str]) -> str | None:
    """Why no new slice may go on ``gpu`` (unhealthy, cordoned, node draining), or None."""
    if not gpu.health.healthy:
        why = "; ".join(gpu.health.reasons) or "unhealthy"
        return f"GPU {gpu.uuid} unhealthy ({why})"
    if gpu.node in draining:
        return f"node {gpu.node} is draining"
    if gpu.uuid in cordoned:
        return f"GPU {gpu.uuid} is cordoned"
    return None


def features_match(offered: Collection[str], wanted: Collection[str]) -> bool:
    """True when a GPU offering ``offered`` serves a request for ``wanted``.

    Every wanted feature must be offered; and a MIG instance (``mig-instance``) serves only
    requests that name a MIG profile (a ``mig:P`` feature, from ``JobSpec.mig_profile``): a job
    that did not ask for a MIG slice never lands on one.
    """
    if MIG_INSTANCE_FEATURE in offered and not any(w.startswith(MIG_PROFILE_PREFIX) for w in wanted):
        return False
    return all(f in offered for f in wanted)


def matches_static(gpu: GpuInfo, features: Collection[str], gpu_model: str | None) -> bool:
    """True when ``gpu`` offers every required feature and is the required model (if any); see :func:`features_match`."""
    if gpu_model is not None and gpu.model.lower() != gpu_model.lower():
        return False
    return features_match(gpu.features, features)


def fits(load: GpuLoad, req: SliceRequest, ratio: float) -> bool:
    """Capacity check of one slice of ``req`` on a GPU with ``load`` (see the module docstring)."""
    if req.qos is QoS.EXCLUSIVE:
        return load.slices == 0 and load.phys >= req.memory
    if load.exclusive:
        return False
    if req.qos is QoS.GUARANTEED:
        return (
            load.reserved + load.shared_quota + req.memory <= load.phys
            and load.compute + req.compute <= 1.0 + COMPUTE_EPS
        )
    return (
        load.shared_quota + req.memory + load.reserved <= ratio * load.phys
        and load.shared_peak + req.peak + load.reserved <= load.phys
    )


def unfit_reason(load: GpuLoad, req: SliceRequest, ratio: float) -> str | None:
    """Why one slice of ``req`` does not fit on a GPU with ``load``, or None when it fits."""
    if req.qos is QoS.EXCLUSIVE:
        if load.phys < req.memory:
            return f"needs {format_size(req.memory)}, GPU has {format_size(load.phys)}"
        if load.slices:
            return "exclusive needs an idle GPU"
        return None
    if load.exclusive:
        return "held exclusively"
    if req.qos is QoS.GUARANTEED:
        free = load.phys - load.reserved - load.shared_quota
        if req.memory > free:
            return f"{format_size(max(free, 0))} free, needs {format_size(req.memory)}"
        if load.compute + req.compute > 1.0 + COMPUTE_EPS:
            return f"compute {1.0 - load.compute:.2f} free, needs {req.compute:.2f}"
        return None
    head = ratio * load.phys - load.reserved - load.shared_quota
    if req.memory > head:
        return f"{format_size(max(head, 0))} shared quota left (ratio {ratio:g}), needs {format_size(req.memory)}"
    peak_room = load.phys - load.reserved - load.shared_peak
    if req.peak > peak_room:
        return f"predicted peaks leave {format_size(max(peak_room, 0))}, needs {format_size(req.peak)}"
    return None
