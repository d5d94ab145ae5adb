"""Right-sizing advice: pure rules from a job's spec, telemetry, slices and prices.

Each rule looks at one signal and, when it fires, says what to change, with the figure, and
an estimate of the saving per hour at current prices. The rules and their thresholds
(:class:`AdviceSettings`) are listed in ``docs/telemetry.md``:

* ``memory_oversized``: the memory quota is far above the observed peak; suggest
  ``ceil(peak * (1 + margin))`` rounded up to a GiB, and a cheaper catalog model it fits on.
* ``compute_oversized``: measured GPU utilisation is well below the compute share.
* ``input_bound``: low utilisation with a large data phase; more DataLoader workers, or a shared slice.
* ``checkpoint_heavy``: the checkpoint phase takes a large share of step time.
* ``idle``: slices are held but no step has finished for a long time; release them.
* ``use_shared``: a low-priority job that checkpoints tolerates preemption; the ``shared``
  class (the pool's spot-like class) costs less.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import Allocation, GiB, GpuInfo, JobSpec, QoS, format_size
from gpupool_sdk.telemetry.pricing import ModelOffer, PriceTable, reference_tflops
from gpupool_sdk.telemetry.summary import TelemetrySummary
from gpupool_sdk.telemetry.usage import hourly_cost


class AdviceKind(str, enum.Enum):
    """What a piece of advice is about."""

    MEMORY_OVERSIZED = "memory_oversized"
    COMPUTE_OVERSIZED = "compute_oversized"
    INPUT_BOUND = "input_bound"
    CHECKPOINT_HEAVY = "checkpoint_heavy"
    IDLE = "idle"
    USE_SHARED = "use_shared"


@dataclass(frozen=True)
class Advice:
    """One recommendation for one job.

    Attributes:
        job: the job it is about.
        kind: which rule fired.
        message: what to change and why, with the figures.
        saving_usd_per_hour: estimated saving per hour at current prices if followed (0 when
            the change frees capacity for others but does not lower this job's bill).
        suggestion: machine-readable detail (``{"memory": "14GiB"}``, ``{"gpu_model": "L4-24GB"}``...).
    """

    job: str
    kind: AdviceKind
    message: str
    saving_usd_per_hour: float = 0.0
    suggestion: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "kind": self.kind.value,
            "message": self.message,
            "saving_usd_per_hour": round(self.saving_usd_per_hour, 6),
            "suggestion": dict(self.suggestion),
        }


@dataclass(frozen=True)
class AdviceSettings:
    """Thresholds of the advice rules.

    Attributes:
        memory_margin: headroom added to the observed peak (0.2 = +20 %).
        memory_round_bytes: the suggested quota is rounded up to a multiple of this.
        memory_oversize_ratio: advise when the suggested quota is at most this fraction of the request.
        low_util: GPU utilisation (0-1) below which a job counts as under-using its compute.
        compute_margin: headroom added to measured utilisation when suggesting a compute share.
        compute_round: the suggested compute share is rounded up to a multiple of this.
        input_bound_data_fraction: data-phase share of step time from which a job is input-bound.
        checkpoint_fraction: checkpoint-phase share of step time from which to advise.
        idle_after_s: seconds without a finished step, while holding slices, to call a job idle.
        preemptible_max_priority: jobs at or below this priority that checkpoint are shared candidates.
    """

    memory_margin: float = 0.2
    memory_round_bytes: int = GiB
    memory_oversize_ratio: float = 0.7
    low_util: float = 0.5
    compute_margin: float = 0.2
    compute_round: float = 0.05
    input_bound_data_fraction: float = 0.3
    checkpoint_fraction: float = 0.1
    idle_after_s: float = 900.0
    preemptible_max_priority: int = 0

    def __post_init__(self) -> None:
        ratios = ("memory_oversize_ratio", "low_util", "input_bound_data_fraction", "checkpoint_fraction")
        for name in ratios:
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ConfigError(name, f"must be a ratio in (0, 1], got {v!r}")
        for name in ("memory_margin", "compute_margin", "idle_after_s"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)!r}")
        if self.memory_round_bytes < 1:
            raise ConfigError("memory_round_bytes", f"must be >= 1 byte, got {self.memory_round_bytes}")
        if not 0.0 < self.compute_round <= 1.0:
            raise ConfigError("compute_round", f"must be in (0, 1], got {self.compute_round}")


def round_up(value: float, step: float) -> float:
    """``value`` rounded up to a multiple of ``step``."""
    return math.ceil(value / step - 1e-9) * step


def suggested_memory(peak_bytes: int, settings: AdviceSettings) -> int:
    """The quota to suggest for an observed peak: ``peak * (1 + margin)`` rounded up.

    Example:
        >>> suggested_memory(10 * GiB, AdviceSettings()) // GiB
        12
    """
    # Exact arithmetic: a float product could push an exact 12 GiB one byte over, to 13 GiB.
    need = math.ceil(peak_bytes * (1 + Fraction(str(settings.memory_margin))))
    step = settings.memory_round_bytes
    return -(-need // step) * step


def _qos_switch_saving(cost: float, qos: QoS, prices: PriceTable) -> float:
    if qos is QoS.SHARED or cost <= 0:
        return 0.0
    current = prices.factor(qos)
    return cost * (1.0 - prices.factor(QoS.SHARED) / current) if current > 0 else 0.0


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def advise(
    spec: JobSpec,
    *,
    telemetry: TelemetrySummary | None,
    allocations: Sequence[Allocation],
    gpus_by_uuid: Mapping[str, GpuInfo],
    prices: PriceTable,
    now: float,
    offers: Iterable[ModelOffer] = (),
    last_checkpoint_at: float | None = None,
    settings: AdviceSettings | None = None,
) -> list[Advice]:
    """Right-sizing advice for one job, most valuable first.

    Args:
        spec: the job's spec.
        telemetry: its latest summary, or None when it never published one.
        allocations: the slices it holds now (empty when pending: cost-based savings are then 0).
        gpus_by_uuid: the pool's GPUs.
        prices: the price table.
        now: wall-clock time to judge idleness against.
        offers: catalog models with prices, for the "cheaper model" part of ``memory_oversized``.
        last_checkpoint_at: when the job last acknowledged a checkpoint, if ever.
        settings: rule thresholds.

    Returns:
        The advice items, sorted by estimated saving (largest first), then kind.

    Example:
        >>> from gpupool_sdk.resources import JobSpec
        >>> advise(JobSpec("j", memory="40GiB"), telemetry=None, allocations=[], gpus_by_uuid={},
        ...        prices=PriceTable(catalog=lambda m: None), now=0.0)
        []
    """
    st = settings or AdviceSettings()
    allocs = [a for a in allocations if a.job == spec.name]
    cost = hourly_cost(allocs, gpus_by_uuid, prices)
    qos = spec.qos_class
    out: list[Advice] = []
    t = telemetry

    out.extend(_memory_rule(spec, t, allocs, gpus_by_uuid, prices, cost, offers, st))
    data_frac = t.phase_fraction.get("data", 0.0) if t else 0.0
    util = t.gpu_util if t else None
    input_bound = t is not None and data_frac >= st.input_bound_data_fraction and (util is None or util < st.low_util)
    if input_bound:
        saving = _qos_switch_saving(cost, qos, prices)
        util_txt = f" while the GPU is {_pct(util)} busy" if util is not None else ""
        shared_txt = "" if qos is QoS.SHARED else ", or move to a shared slice"
        out.append(
            Advice(
                spec.name,
                AdviceKind.INPUT_BOUND,
                f"input-bound: {_pct(data_frac)} of each step waits for data{util_txt}; raise DataLoader "
                f"num_workers / prefetch_factor (and pin_memory=True){shared_txt}",
                saving,
                {"data_fraction": round(data_frac, 3), "qos": QoS.SHARED.value},
            )
        )
    elif util is not None and util < st.low_util:
        out.extend(_compute_rule(spec, util, allocs, gpus_by_uuid, prices, cost, st))

    ckpt = t.phase_fraction.get("checkpoint", 0.0) if t else 0.0
    if ckpt >= st.checkpoint_fraction:
        out.append(
            Advice(
                spec.name,
                AdviceKind.CHECKPOINT_HEAVY,
                f"checkpointing takes {_pct(ckpt)} of step time: checkpoint less often (e.g. raise "
                "every_n_train_steps) or asynchronously (AsyncCheckpointIO)",
                cost * ckpt,
                {"checkpoint_fraction": round(ckpt, 3)},
            )
        )

    idle = _idle_rule(spec, t, allocs, now, cost, st)
    if idle is not None:
        out.append(idle)

    checkpoints = last_checkpoint_at is not None or (t is not None and t.phase_seconds.get("checkpoint", 0.0) > 0)
    if (
        not input_bound
        and qos is not QoS.SHARED
        and spec.priority <= st.preemptible_max_priority
        and checkpoints
    ):
        saving = _qos_switch_saving(cost, qos, prices)
        out.append(
            Advice(
                spec.name,
                AdviceKind.USE_SHARED,
                f"priority {spec.priority} and checkpointing: this job tolerates preemption; run it with "
                f"qos='shared' (the pool's spot-like class, charged x{prices.factor(QoS.SHARED):g})",
                saving,
                {"qos": QoS.SHARED.value},
            )
        )
    return sorted(out, key=lambda a: (-a.saving_usd_per_hour, a.kind.value))


def _memory_rule(
    spec: JobSpec,
    t: TelemetrySummary | None,
    allocs: list[Allocation],
    gpus: Mapping[str, GpuInfo],
    prices: PriceTable,
    cost: float,
    offers: Iterable[ModelOffer],
    st: AdviceSettings,
) -> list[Advice]:
    if t is None or not t.memory_peak_bytes:
        return []
    requested = spec.memory_bytes
    if requested == 0:  # exclusive: the whole GPU
        sizes = [gpus[a.gpu_uuid].memory_bytes for a in allocs if a.gpu_uuid in gpus]
        requested = min(sizes) if sizes else 0
    if requested <= 0:
        return []
    target = suggested_memory(t.memory_peak_bytes, st)
    if target > st.memory_oversize_ratio * requested:
        return []
    shrunk = [replace(a, memory_bytes=min(a.memory_bytes, target)) for a in allocs]
    saving = max(0.0, cost - hourly_cost(shrunk, gpus, prices)) if spec.qos_class is not QoS.EXCLUSIVE else 0.0
    suggestion: dict[str, Any] = {"memory": format_size(target), "memory_bytes": target}
    msg = (
        f"memory quota {format_size(requested)} per slice is far above the observed peak "
        f"{format_size(t.memory_peak_bytes)}: ask for memory='{_gib(target)}'"
    )
    cheaper = _cheaper_model(spec, target, allocs, gpus, prices, cost, offers, t.gpu_util, st)
    if cheaper is not None and cheaper[1] > saving:
        offer, model_saving = cheaper
        msg += (
            f"; a slice of {offer.name} ({format_size(offer.memory_bytes)}) holds it with the compute it uses, "
            f"saving ${model_saving:.2f}/h (gpu_model='{offer.name}')"
        )
        suggestion["gpu_model"] = offer.name
        saving = model_saving
    elif saving > 0:
        msg += f", saving ${saving:.2f}/h"
    return [Advice(spec.name, AdviceKind.MEMORY_OVERSIZED, msg, saving, suggestion)]


def _gib(nbytes: int) -> str:
    return f"{nbytes // GiB}GiB" if nbytes % GiB == 0 else format_size(nbytes)


def _cheaper_model(
    spec: JobSpec,
    target: int,
    allocs: list[Allocation],
    gpus: Mapping[str, GpuInfo],
    prices: PriceTable,
    cost: float,
    offers: Iterable[ModelOffer],
    util: float | None,
    st: AdviceSettings,
) -> tuple[ModelOffer, float] | None:
    """The catalog model saving most per hour that holds ``target`` bytes and the job's compute.

    The compute the job needs is what it uses now: measured utilisation (plus margin) of the
    current GPU's TFLOPS when known, else its whole compute share. A model whose TFLOPS are
    unknown on either side is judged on memory alone.
    """
    if not allocs or cost <= 0:
        return None
    offers = list(offers)
    by_name = {o.name: o for o in offers}
    current = [gpus[a.gpu_uuid] for a in allocs if a.gpu_uuid in gpus]
    current_models = {g.model for g in current}
    cur_tflops = min(
        (reference_tflops(g.tflops) or getattr(by_name.get(g.model), "tflops", 0.0) for g in current), default=0.0
    )
    share_now = 1.0 if spec.qos_class is QoS.EXCLUSIVE else spec.compute_share
    used = min(share_now, util * (1.0 + st.compute_margin)) if util is not None else share_now
    needed_tflops = cur_tflops * used
    needed = set(spec.features) - {"nvlink"}  # NVLink is a topology wish, not a model property here
    best: tuple[ModelOffer, float] | None = None
    for offer in offers:
        if offer.name in current_models or offer.memory_bytes < target:
            continue
        if needed and offer.features and not needed <= offer.features:
            continue
        compute_share = spec.compute_share
        if needed_tflops > 0 and offer.tflops > 0:
            compute_share = round_up(needed_tflops / offer.tflops, st.compute_round)
            if compute_share > 1.0:
                continue  # too slow: the job would run longer than it saves
        price = prices.price_per_hour(offer.name, spec.qos_class)
        if price is None:  # not priced by the table: the offer's own list price
            price = offer.price_per_hour_usd * prices.factor(spec.qos_class)
        if spec.qos_class is QoS.EXCLUSIVE:
            share = 1.0
        else:
            share = min(1.0, max(compute_share, target / offer.memory_bytes))
        saving = cost - share * price * len(allocs)
        if saving > 0 and (best is None or saving > best[1]):
            best = (offer, saving)
    return best


def _compute_rule(
    spec: JobSpec,
    util: float,
    allocs: list[Allocation],
    gpus: Mapping[str, GpuInfo],
    prices: PriceTable,
    cost: float,
    st: AdviceSettings,
) -> list[Advice]:
    current = 1.0 if spec.qos_class is QoS.EXCLUSIVE else spec.compute_share
    target = min(1.0, round_up(max(util, 0.01) * (1.0 + st.compute_margin), st.compute_round))
    if target >= current * 0.8:
        return []
    target = round(target, 4)
    new_mode = QoS.GUARANTEED if spec.qos_class is QoS.EXCLUSIVE else spec.qos_class
    shrunk = [replace(a, compute_share=min(a.compute_share, target), mode=new_mode) for a in allocs]
    saving = max(0.0, cost - hourly_cost(shrunk, gpus, prices))
    extra = " as a guaranteed slice" if spec.qos_class is QoS.EXCLUSIVE else ""
    return [
        Advice(
            spec.name,
            AdviceKind.COMPUTE_OVERSIZED,
            f"GPU utilisation is {_pct(util)} of a compute share of {current:g}: ask for "
            f"compute_share={target:g}{extra}" + (f", saving ${saving:.2f}/h" if saving > 0 else ""),
            saving,
            {"compute_share": target, "qos": new_mode.value},
        )
    ]


def _idle_rule(
    spec: JobSpec,
    t: TelemetrySummary | None,
    allocs: list[Allocation],
    now: float,
    cost: float,
    st: AdviceSettings,
) -> Advice | None:
    if not allocs:
        return None
    granted = [a.granted_at for a in allocs if a.granted_at > 0]
    marks: list[float] = []
    if granted:
        marks.append(min(granted))
    if t is not None:
        if t.last_step_at is not None:
            marks.append(t.last_step_at)
        elif t.steps_per_s > 0 and t.published_at > 0:
            marks.append(t.published_at)
    if not marks:
        return None
    last_activity = max(marks)
    idle_s = now - last_activity
    if idle_s < st.idle_after_s:
        return None
    return Advice(
        spec.name,
        AdviceKind.IDLE,
        f"holds {len(allocs)} slice(s) but no training step finished for {idle_s / 60:.0f} min: "
        "release them (stop the job, or let it exit) and resubmit when ready",
        cost,
        {"idle_s": round(idle_s, 1)},
    )
