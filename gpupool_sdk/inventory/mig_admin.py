"""Operator actions on MIG through NVML: list, enable/disable MIG mode, create and destroy instances.

Creating and destroying MIG instances is never done by the pool on its own: it changes what the
GPU is (a running job on the whole GPU would lose it) and needs root. ``gpupool mig`` calls these
functions on the machine whose GPUs it changes; the node agent then publishes the new instances
at its next refresh.

Each GPU instance is created with one compute instance covering it (what ``nvidia-smi mig -cgi
PROFILE -C`` does), so every instance is one CUDA device.

All functions take the NVML module (``pynvml``, or the test suite's fake).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpupool_sdk.errors import ConfigError, GpupoolError
from gpupool_sdk.inventory.nvml import mig_profile_name

# GPU-instance profile ids (NVML_GPU_INSTANCE_PROFILE_*), tried in this order; REV1 of one slice
# is the "+me" (media extensions) variant, REV2 the 1g with twice the memory.
_GI_PROFILES = ((0, ""), (7, "+me"), (9, ""), (1, ""), (2, ""), (3, ""), (4, ""))
# Compute-instance profile id covering a whole GPU instance of N slices (NVML_COMPUTE_INSTANCE_PROFILE_*).
_CI_FOR_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 6: 6, 7: 4, 8: 5}
_CI_ENGINE_SHARED = 0  # NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
_ERR_NOT_SUPPORTED = 3
_ERR_NO_PERMISSION = 4
_ERR_INSUFFICIENT_RESOURCES = 23  # NVML_ERROR_INSUFFICIENT_RESOURCES


class MigAdminError(GpupoolError):
    """A MIG operation failed; the message says why and what to do."""


@dataclass(frozen=True)
class GpuMigState:
    """One GPU's MIG state as ``gpupool mig list`` shows it."""

    index: int
    uuid: str
    name: str
    mig_current: bool | None
    mig_pending: bool | None
    profiles: tuple[str, ...]
    instances: tuple[tuple[str, str], ...]  # (profile, uuid)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "mig_enabled": self.mig_current,
            "mig_pending": self.mig_pending,
            "profiles": list(self.profiles),
            "instances": [{"profile": p, "uuid": u} for p, u in self.instances],
        }


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _handle(nv: Any, index: int) -> Any:
    count = nv.nvmlDeviceGetCount()
    if not 0 <= index < count:
        raise ConfigError("gpu", f"GPU index {index} does not exist; this machine has GPUs 0..{count - 1}")
    return nv.nvmlDeviceGetHandleByIndex(index)


def _mode(nv: Any, h: Any) -> tuple[bool, bool] | None:
    try:
        cur, pending = nv.nvmlDeviceGetMigMode(h)
    except nv.NVMLError as e:
        if getattr(e, "value", None) == _ERR_NOT_SUPPORTED:
            return None
        raise
    return int(cur) == 1, int(pending) == 1


def gi_profiles(nv: Any, h: Any) -> dict[str, Any]:
    """The GPU-instance profiles this GPU offers, by nvidia-smi name, with NVML's profile info."""
    out: dict[str, Any] = {}
    for pid, suffix in _GI_PROFILES:
        try:
            info = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, pid)
        except nv.NVMLError:
            continue  # not offered by this GPU
        name = mig_profile_name(int(info.sliceCount), int(info.sliceCount), int(info.memorySizeMB)) + suffix
        out.setdefault(name, info)
    return out


def _instances(nv: Any, h: Any) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    try:
        top = int(nv.nvmlDeviceGetMaxMigDeviceCount(h))
    except nv.NVMLError:
        return out
    for k in range(top):
        try:
            m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
        except nv.NVMLError:
            continue
        attrs = nv.nvmlDeviceGetAttributes(m)
        name = mig_profile_name(attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount, attrs.memorySizeMB)
        out.append((name, _text(nv.nvmlDeviceGetUUID(m))))
    return out


def list_gpus(nv: Any) -> list[GpuMigState]:
    """Every GPU's MIG mode, offered profiles and existing instances."""
    out = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        mode = _mode(nv, h)
        enabled = mode is not None and mode[0]
        out.append(
            GpuMigState(
                index=i,
                uuid=_text(nv.nvmlDeviceGetUUID(h)),
                name=_text(nv.nvmlDeviceGetName(h)),
                mig_current=None if mode is None else mode[0],
                mig_pending=None if mode is None else mode[1],
                profiles=tuple(gi_profiles(nv, h)) if enabled else (),
                instances=tuple(_instances(nv, h)) if enabled else (),
            )
        )
    return out


def set_mig_mode(nv: Any, index: int, enabled: bool) -> bool:
    """Enable or disable MIG mode on GPU ``index``; True when it is in force now, False when a GPU reset is pending."""
    h = _handle(nv, index)
    if _mode(nv, h) is None:
        raise MigAdminError(f"GPU {index} does not support MIG (A100, H100 and H200 do)")
    try:
        nv.nvmlDeviceSetMigMode(h, 1 if enabled else 0)
    except nv.NVMLError as e:
        raise MigAdminError(_why(e, f"set MIG mode on GPU {index}")) from None
    mode = _mode(nv, h)
    return mode is not None and mode[0] == enabled


def create_instances(nv: Any, index: int, profile: str, count: int = 1) -> list[str]:
    """Create ``count`` GPU instances of ``profile`` (each with one full compute instance) on GPU ``index``.

    Returns:
        The profile names created (the agent publishes their UUIDs at its next refresh).

    Raises:
        ConfigError: no such GPU, or a profile this GPU does not offer (the message lists them).
        MigAdminError: MIG mode is off, or NVML refused (no room left, no permission).
    """
    if count < 1:
        raise ConfigError("count", f"must be >= 1, got {count}")
    h = _handle(nv, index)
    mode = _mode(nv, h)
    if mode is None or not mode[0]:
        raise MigAdminError(
            f"MIG mode is not enabled on GPU {index}; run `gpupool mig enable --gpu {index}` (as root), "
            "reset the GPU if it says a reset is pending, then create instances"
        )
    offered = gi_profiles(nv, h)
    key = profile.strip().lower()
    if key not in offered:
        raise ConfigError("profile", f"{profile!r} is not offered by GPU {index}; use one of {', '.join(offered)}")
    info = offered[key]
    made: list[str] = []
    for _ in range(count):
        try:
            gi = nv.nvmlDeviceCreateGpuInstance(h, info.id)
            ci_info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, _CI_FOR_SLICES[int(info.sliceCount)], _CI_ENGINE_SHARED)
            nv.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
        except nv.NVMLError as e:
            raise MigAdminError(_why(e, f"create a {key} instance on GPU {index} (created {len(made)} of {count})")) from None
        made.append(key)
    return made


def destroy_instances(nv: Any, index: int, profile: str | None = None) -> int:
    """Destroy the GPU instances of GPU ``index`` (only those of ``profile`` when given); returns how many.

    Raises:
        MigAdminError: NVML refused (an instance is in use by a process, no permission).
    """
    h = _handle(nv, index)
    mode = _mode(nv, h)
    if mode is None or not mode[0]:
        return 0
    offered = gi_profiles(nv, h)
    if profile is not None and profile.strip().lower() not in offered:
        raise ConfigError("profile", f"{profile!r} is not offered by GPU {index}; use one of {', '.join(offered)}")
    n = 0
    for name, info in offered.items():
        if profile is not None and name != profile.strip().lower():
            continue
        try:
            gis = list(nv.nvmlDeviceGetGpuInstances(h, info.id))
        except nv.NVMLError:
            continue
        for gi in gis:
            try:
                for cid in set(_CI_FOR_SLICES.values()):
                    try:
                        cis = list(nv.nvmlGpuInstanceGetComputeInstances(gi, cid))
                    except nv.NVMLError:
                        continue
                    for ci in cis:
                        nv.nvmlComputeInstanceDestroy(ci)
                nv.nvmlGpuInstanceDestroy(gi)
            except nv.NVMLError as e:
                raise MigAdminError(_why(e, f"destroy a {name} instance on GPU {index} (destroyed {n})")) from None
            n += 1
    return n


def _why(e: Any, what: str) -> str:
    code = getattr(e, "value", None)
    if code == _ERR_NO_PERMISSION:
        return f"cannot {what}: permission denied (MIG changes need root)"
    if code == _ERR_INSUFFICIENT_RESOURCES:
        return f"cannot {what}: no room left on the GPU for it (destroy instances first, or pick a smaller profile)"
    if code == 19:  # NVML_ERROR_IN_USE
        return f"cannot {what}: in use by a process (stop the jobs on it first)"
    return f"cannot {what}: {e}"
