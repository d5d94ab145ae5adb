"""The GPU health verdict: one pure function from a sample to :class:`GpuHealth`.

Rules (a GPU is unhealthy when any holds; every one that holds is a reason):

- **ECC double-bit errors**: the volatile (since the last driver load) uncorrectable ECC count is
  above zero. Uncorrectable errors mean data corruption; the driver retires or remaps the page,
  and the GPU needs a reset before it can be trusted again.
- **Fatal XID**: an XID event whose code is in :data:`FATAL_XIDS` was seen (see the table there;
  meanings from NVIDIA's "XID Errors" catalog, docs.nvidia.com/deploy/xid-errors).
- **Over-temperature**: the GPU core temperature is at or above the threshold (90 C by default:
  data-centre parts start hardware slowdown a few degrees above it).
- **GPU lost**: NVML reported the GPU as lost (fallen off the bus).

Power draw and the usage readings (:class:`~gpupool_sdk.resources.GpuReadings`: utilisation,
memory-bandwidth utilisation, memory used, PCIe and NVLink throughput) are reported, not judged: a
GPU at its power cap or at 100 % is busy, not broken. The verdict does not carry the usage readings;
the agent publishes them under a key of their own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources.gpu import GpuHealth, GpuReadings

#: XID codes that make a GPU unusable until it is reset or serviced, with their meaning.
FATAL_XIDS: Mapping[int, str] = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error (application must restart)",
    95: "uncontained ECC error (GPU reset required)",
    119: "GSP RPC timeout",
    120: "GSP error",
}

DEFAULT_MAX_TEMPERATURE_C = 90.0


@dataclass(frozen=True)
class HealthThresholds:
    """Operator-tunable health limits.

    Args:
        max_temperature_c: at or above this core temperature the GPU is unhealthy.
        fatal_xids: XID codes that make a GPU unhealthy.

    Raises:
        ConfigError: the temperature is not a number in (0, 150].
    """

    max_temperature_c: float = DEFAULT_MAX_TEMPERATURE_C
    fatal_xids: frozenset[int] = field(default_factory=lambda: frozenset(FATAL_XIDS))

    def __post_init__(self) -> None:
        t = self.max_temperature_c
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 < t <= 150:
            raise ConfigError("max_temperature_c", f"must be a temperature in (0, 150] degrees C, got {t!r}")
        object.__setattr__(self, "max_temperature_c", float(t))
        object.__setattr__(self, "fatal_xids", frozenset(int(x) for x in self.fatal_xids))


@dataclass(frozen=True)
class HealthSample:
    """Raw health readings of one GPU; None where the GPU does not report the field.

    Attributes:
        temperature_c: core temperature.
        power_w: power draw.
        ecc_double_bit: volatile uncorrectable ECC error count.
        xids: XID codes seen (accumulated by the backend).
        lost: NVML reported the GPU as lost.
        readings: the usage readings (utilisation, memory bandwidth, memory used, PCIe and
            NVLink bytes/s), all unknown by default.
    """

    temperature_c: float | None = None
    power_w: float | None = None
    ecc_double_bit: int | None = None
    xids: tuple[int, ...] = ()
    lost: bool = False
    readings: GpuReadings = field(default_factory=GpuReadings)


def judge_health(sample: HealthSample, thresholds: HealthThresholds | None = None) -> GpuHealth:
    """Turn readings into a verdict (pure: no I/O, no clock).

    Args:
        sample: the readings.
        thresholds: limits; the defaults when None.

    Returns:
        The verdict, carrying temperature, power, ECC and XIDs and one reason per rule that fired
        (not the usage readings: they stay in ``sample.readings``).

    Example:
        >>> judge_health(HealthSample(temperature_c=95.0)).reasons
        ('temperature 95C >= 90C',)
    """
    th = thresholds or HealthThresholds()
    reasons: list[str] = []
    if sample.lost:
        reasons.append("gpu is lost (fell off the bus or the driver lost it)")
    if sample.ecc_double_bit is not None and sample.ecc_double_bit > 0:
        reasons.append(f"ecc double-bit errors: {sample.ecc_double_bit}")
    for xid in sorted(set(sample.xids)):
        if xid in th.fatal_xids:
            meaning = FATAL_XIDS.get(xid)
            reasons.append(f"xid {xid}" + (f" ({meaning})" if meaning else ""))
    if sample.temperature_c is not None and sample.temperature_c >= th.max_temperature_c:
        reasons.append(f"temperature {sample.temperature_c:g}C >= {th.max_temperature_c:g}C")
    return GpuHealth(
        healthy=not reasons,
        reasons=tuple(reasons),
        temperature_c=sample.temperature_c,
        power_w=sample.power_w,
        ecc_double_bit=sample.ecc_double_bit,
        xids=tuple(sorted(set(sample.xids))),
    )
