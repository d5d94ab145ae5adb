"""MIG (Multi-Instance GPU): the profiles of each model and the published record of one instance.

A GPU in MIG mode runs CUDA work only inside its GPU instances, so the agent publishes each
instance as a GPU of its own (``gpus/{node}/{MIG-uuid}``) and not the parent: its own UUID (what
``CUDA_VISIBLE_DEVICES`` names), its profile, memory and SM count, the parent's index and UUID
(``mig_parent``), and the features ``mig-instance`` and ``mig:{profile}``. The scheduler places
on it only jobs that ask for that profile (``JobSpec.mig_profile``).

Profiles are the GPU-instance profiles NVIDIA documents in the MIG user guide ("Supported MIG
Profiles"); SM counts per compute slice from the same guide (A100: 14 per slice, 98 in 7g;
H100/H200: 16, 32, 60, 64, 132 for 1g, 2g, 3g, 4g, 7g). Memory is the profile's nominal size in
GiB for simulated instances; real ones publish what NVML reports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from gpupool_sdk.errors import SpecError
from gpupool_sdk.resources.gpu import MIG_INSTANCE_FEATURE, GpuInfo, mig_feature
from gpupool_sdk.resources.units import GiB

#: compute slices of a whole GPU in MIG mode (A100, H100, H200).
COMPUTE_SLICES = 7

_A100_SM = {1: 14, 2: 28, 3: 42, 4: 56, 7: 98}
_H100_SM = {1: 16, 2: 32, 3: 60, 4: 64, 7: 132}
_PROFILE_RE = re.compile(r"^(?:\d+c\.)?(?P<g>\d+)g\.(?P<gb>\d+)gb(?:\+(?P<ext>[a-z]+))?$")

#: GPU-instance profiles by catalog model.
PROFILES: dict[str, tuple[str, ...]] = {
    "A100-40GB": ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    "A100-80GB": ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H100-80GB": ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H100-PCIe-80GB": ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H200-141GB": ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
}


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile: its name, compute slices, nominal memory and SM count on a model."""

    name: str
    compute_slices: int
    memory_gb: int
    sm_count: int


def profile_of(model: str, name: str, where: str = "mig") -> MigProfile:
    """The profile ``name`` on catalog ``model``.

    Raises:
        SpecError: the model has no MIG or not this profile; the message lists the model's profiles.
    """
    names = PROFILES.get(model)
    if names is None:
        raise SpecError(where, f"{model} has no MIG; MIG GPUs: {', '.join(sorted(PROFILES))}")
    key = name.strip().lower()
    if key not in names:
        raise SpecError(where, f"{name!r} is not a MIG profile of {model}; use one of {', '.join(names)}")
    return _profile(model, key)


def _profile(model: str, name: str) -> MigProfile:
    m = _PROFILE_RE.match(name)
    assert m is not None, name
    g = int(m.group("g"))
    sms = (_H100_SM if model.startswith("H") else _A100_SM).get(g, 0)
    return MigProfile(name, g, int(m.group("gb")), sms)


def parse_layout(text: str, model: str, memory_bytes: int, where: str = "mig") -> tuple[MigProfile, ...]:
    """Parse a ``+``-separated instance layout (``"3g.40gb+3g.40gb"``) for one GPU of ``model``.

    Raises:
        SpecError: an unknown profile, more than 7 compute slices, or more memory than the GPU has.
    """
    parts = [p.strip() for p in text.split("+") if p.strip()]
    # "1g.10gb+me" is one profile: re-join a media-extension suffix with its profile.
    joined: list[str] = []
    for p in parts:
        if joined and re.fullmatch(r"[a-z]+", p.lower()):
            joined[-1] += "+" + p.lower()
        else:
            joined.append(p)
    if not joined:
        raise SpecError(where, f"declares no MIG instances; write e.g. 'mig=3g.40gb+3g.40gb' ({model}: {', '.join(PROFILES.get(model, ()))})")
    profiles = tuple(profile_of(model, p, where) for p in joined)
    slices = sum(p.compute_slices for p in profiles)
    if slices > COMPUTE_SLICES:
        raise SpecError(where, f"the instances use {slices} compute slices; a {model} has {COMPUTE_SLICES}")
    mem = sum(p.memory_gb for p in profiles) * GiB
    if mem > memory_bytes:
        raise SpecError(where, f"the instances need {mem // GiB} GiB; a {model} has {memory_bytes // GiB} GiB")
    return profiles


def mig_instance(
    parent: GpuInfo, profile: str, uuid: str, memory_bytes: int, sm_count: int, compute_slices: int | None = None
) -> GpuInfo:
    """The published record of one MIG instance of ``parent``.

    Args:
        parent: the whole GPU (its identity, model, health, NUMA node, PCIe path are inherited).
        profile: the instance's profile name.
        uuid: the instance's ``MIG-...`` UUID.
        memory_bytes: the instance's memory.
        sm_count: its SMs.
        compute_slices: its compute slices (for the TFLOPS share); default from the profile name.
    """
    m = _PROFILE_RE.match(profile)
    g = compute_slices if compute_slices is not None else (int(m.group("g")) if m else 1)
    frac = min(1.0, g / COMPUTE_SLICES)
    mem_frac = min(1.0, memory_bytes / parent.memory_bytes) if parent.memory_bytes else 0.0
    features = tuple(
        sorted({f for f in parent.features if f not in ("mig", "nvlink")} | {MIG_INSTANCE_FEATURE, mig_feature(profile)})
    )
    return replace(
        parent,
        uuid=uuid,
        memory_bytes=memory_bytes,
        sm_count=sm_count,
        tflops={k: round(v * frac, 3) for k, v in parent.tflops.items()},
        memory_bandwidth_gbps=round(parent.memory_bandwidth_gbps * mem_frac, 1),
        features=features,
        nvlink_peers=(),
        nvlink_island=None,
        mig_profile=profile,
        mig_parent=parent.uuid,
    )


def simulated_mig_uuid(parent_uuid: str, k: int) -> str:
    """Stable UUID of simulated instance ``k`` of a simulated GPU: ``MIG-sim-{node}-{index}-{k}``."""
    return "MIG-" + parent_uuid.removeprefix("GPU-") + f"-{k}"


def simulated_instances(parent: GpuInfo, layout: tuple[MigProfile, ...]) -> list[GpuInfo]:
    """The simulated instances of ``parent`` for a parsed layout."""
    return [
        mig_instance(parent, p.name, simulated_mig_uuid(parent.uuid, k), p.memory_gb * GiB, p.sm_count, p.compute_slices)
        for k, p in enumerate(layout)
    ]
