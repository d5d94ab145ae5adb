"""Sharing a GPU from inside the training process: CUDA MPS limits or step-level time-slicing.

What a grant means for sharing is decided once per grant, from the job's allocations on this node
and the published records of those GPUs (:func:`plan_sharing`, pure):

* ``mps``: the agent runs an MPS control daemon for the GPU (``mps_pipe_dir`` on its record). The
  job's process gets ``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (its
  compute share) and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (its quota): the GPU enforces both.
* ``timeslice``: a shared (not exclusive) slice of a GPU without MPS. The job runs a
  :class:`~gpupool_sdk.client.timeslice.TimeSliceGate` on it: while another gated job holds a
  slice of the same GPU they take turns at step boundaries, each for a quantum proportional to
  its compute share. Alone on the GPU, the gate lets every step through.
* ``mig``: only MIG instances, not shared: the hardware isolates them.
* ``none``: whole GPUs (``exclusive``), or no local slice.

:class:`JobSharing` carries a plan out in the training process; :class:`~gpupool_sdk.runtime.runtime.PoolRuntime`
calls it at four points: the grant (``on_grant``/``from_launcher``), training start (``start``:
the gate's keeper process starts and registers), the step boundary (``turn``, only while another
gated job shares the GPU) and training end (``stop``). The per-step fast path is unchanged: the
gate raises the runtime's attention flag (``DirectiveInbox.contended``) while contended, so a job
alone on its GPU, gated or not, pays the same one attribute read per step as before.

**Ordering constraint (MPS).** CUDA reads the MPS variables once, when it initialises in the
process. The runtime puts them into ``os.environ`` at the grant, which is why
``GpuPoolCallback(...)`` / ``PoolSession(...)`` must be built before anything touches CUDA
(``torch.cuda.is_available()`` does not initialise it; ``torch.cuda.init()``, a tensor on
``"cuda"`` or ``torch.cuda.device_count()`` under some drivers do). If CUDA is already up, the
runtime logs a warning saying the limits do not apply to this process. Under ``gpupool run`` the
launcher sets them in the script's environment before the script starts, which always holds;
worker processes (DDP ranks started by Lightning, DataLoader workers) inherit them.

**Hand-over offload.** When a turn passes and the memory quotas of the GPU's jobs do not fit its
memory together (``shared`` slices overcommitted by the operator's ratio), the job handing the
GPU over parks its memory (``park()`` of the framework's balloon controller: cached blocks
released, optimizer state moved to host memory) and restores it when its turn comes back,
before its quantum starts. ``handover_offload="always"`` does it at every hand-over,
``"never"`` never.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpupool_sdk.client.mps import ACTIVE_THREAD_ENV, is_mig, mps_environment
from gpupool_sdk.errors import ConfigError, GpupoolError
from gpupool_sdk.resources import Allocation, GpuInfo, QoS

log = logging.getLogger("gpupool_sdk.runtime")

#: Set by ``gpupool run`` in the script's environment: the plan (JSON of :meth:`SharingPlan.to_dict`).
SHARING_ENV = "GPUPOOL_SHARING"

#: The mechanisms a plan (and ``gpupool status``) names.
MECHANISMS = ("none", "mps", "timeslice", "mig")

#: Values of the runtime options ``sharing`` and ``handover_offload``.
SHARING_MODES = ("auto", "off")
OFFLOAD_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class SharingPlan:
    """How this process shares its GPUs (see the module docstring).

    Attributes:
        mechanism: ``none``, ``mps``, ``timeslice`` or ``mig``.
        node: the node of the slices.
        gpu_uuid: the GPU the time-slicing gate runs on (``timeslice`` only).
        compute_share: the gated slice's compute share (the weight of its turns).
        env: environment for the process before CUDA initialises (the MPS variables; may be
            empty).
        ungated: other shared GPUs of a multi-GPU job that no gate covers (one gate per job:
            two gates in one loop could wait on each other).
    """

    mechanism: str = "none"
    node: str = ""
    gpu_uuid: str | None = None
    compute_share: float = 1.0
    env: Mapping[str, str] = field(default_factory=dict)
    ungated: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (``$GPUPOOL_SHARING``; ``env`` travels as variables of its own)."""
        return {"mechanism": self.mechanism, "node": self.node, "gpu_uuid": self.gpu_uuid,
                "compute_share": self.compute_share, "ungated": list(self.ungated)}

    @classmethod
    def from_env(cls, text: str) -> SharingPlan:
        """Read ``$GPUPOOL_SHARING``.

        Raises:
            ConfigError: not the JSON ``gpupool run`` writes (naming the variable).
        """
        try:
            d = json.loads(text)
            mechanism = str(d["mechanism"])
            if mechanism not in MECHANISMS:
                raise ValueError(f"unknown mechanism {mechanism!r}")
            share = float(d.get("compute_share", 1.0))
            gpu = d.get("gpu_uuid")
            if mechanism == "timeslice" and not gpu:
                raise ValueError("timeslice without gpu_uuid")
            return cls(mechanism=mechanism, node=str(d.get("node", "")), gpu_uuid=None if gpu is None else str(gpu),
                       compute_share=share, ungated=tuple(str(x) for x in d.get("ungated", ())))
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(
                SHARING_ENV,
                f"not a sharing plan written by `gpupool run` ({exc}); unset it, or run the script under a matching "
                "gpupool-sdk version",
            ) from None


def plan_sharing(allocations: Iterable[Allocation], node: str, gpus: Iterable[GpuInfo] = (),
                 enabled: bool = True) -> SharingPlan:
    """How the job's slices on ``node`` are shared (pure).

    Args:
        allocations: the job's granted slices (any node; only ``node``'s count).
        node: the node this process runs on.
        gpus: published records of those GPUs (``mps_pipe_dir``); missing ones count as no MPS.
        enabled: False (``sharing="off"``): nothing is enforced from the job's side.

    Returns:
        The plan; see the module docstring for the rule.

    Example:
        >>> a = Allocation("bert", "node-a", "GPU-1", 0, 2**30, 0.3, QoS.GUARANTEED)
        >>> p = plan_sharing([a], "node-a")
        >>> p.mechanism, p.gpu_uuid, p.compute_share
        ('timeslice', 'GPU-1', 0.3)
    """
    seen: dict[str, Allocation] = {}
    for a in sorted(allocations, key=lambda a: (a.gpu_index, a.gpu_uuid)):
        if a.node == node and a.gpu_uuid not in seen:
            seen[a.gpu_uuid] = a
    local = list(seen.values())
    if not local or not enabled:
        return SharingPlan(node=node)
    records = {g.uuid: g for g in gpus}
    pipe = next((records[a.gpu_uuid].mps_pipe_dir for a in local
                 if a.gpu_uuid in records and records[a.gpu_uuid].mps_pipe_dir), None)
    env = mps_environment(local, node, pipe) if pipe else {}
    if ACTIVE_THREAD_ENV in env:
        return SharingPlan("mps", node, env=env)
    shared = [a for a in local if a.mode is not QoS.EXCLUSIVE
              and not (a.gpu_uuid in records and records[a.gpu_uuid].mps_pipe_dir)]
    if shared:
        first = shared[0]
        return SharingPlan("timeslice", node, first.gpu_uuid, first.compute_share, env,
                           tuple(a.gpu_uuid for a in shared[1:]))
    if all(is_mig(a.gpu_uuid) for a in local):
        return SharingPlan("mig", node, env=env)
    return SharingPlan("none", node, env=env)


def launcher_environment(lease: Any, client: Any) -> dict[str, str]:
    """``gpupool run``: the script's sharing environment, set before it starts (so before CUDA).

    The MPS variables of the grant (when the agent runs MPS for its GPUs) and ``$GPUPOOL_SHARING``,
    the plan the script's runtime reads to run its time-slicing gate.

    Args:
        lease: the launcher's granted ``Lease`` (its ``allocations`` and ``node``).
        client: the launcher's ``PoolClient`` (reads the GPU records).
    """
    node = getattr(lease, "node", "") or ""
    gpus: list[GpuInfo] = []
    read = getattr(client, "gpus", None)
    try:
        gpus = list(read(node)) if node and callable(read) else []
    except GpupoolError as exc:
        log.warning("gpupool run: could not read the GPU records of %s (%s); assuming no MPS", node, exc)
    allocations = getattr(lease, "allocations", ())
    plan = plan_sharing(allocations if isinstance(allocations, tuple) else (), node, gpus)
    env = dict(plan.env)
    env[SHARING_ENV] = json.dumps(plan.to_dict())
    return env


def apply_environment(env: Mapping[str, str], environ: MutableMapping[str, str] | None = None) -> bool:
    """Put ``env`` into the process environment; warn when CUDA already initialised (it would not see it).

    Returns:
        True when the variables can still take effect (CUDA not initialised in this process).
    """
    target = os.environ if environ is None else environ
    for k, v in env.items():
        target[k] = v
    if not env:
        return True
    torch = sys.modules.get("torch")  # never import it here: the core does not depend on torch
    initialised = False
    with contextlib.suppress(Exception):
        initialised = bool(torch is not None and torch.cuda.is_initialized())
    if initialised:
        log.warning(
            "gpupool: CUDA was initialised in this process before the pool's grant, so the MPS limits (%s) do not "
            "apply to it; build GpuPoolCallback/PoolSession before anything touches CUDA, or run the script under "
            "`gpupool run`", ", ".join(f"{k}={v}" for k, v in sorted(env.items())))
    return not initialised


class JobSharing:
    """The in-job side of a sharing plan: the MPS environment, the time-slicing gate, the hand-over offload.

    Args:
        job: the job name.
        inbox: the runtime's ``DirectiveInbox`` (its ``contended`` and ``attention`` flags are
            raised while another gated job shares the GPU).
        mode: ``"auto"`` (MPS where the agent runs it, else time-slicing of shared slices) or
            ``"off"`` (neither: the job runs unthrottled, as before).
        period_s: the time-slicing period (one round of turns).
        offload: ``"auto"``, ``"always"`` or ``"never"`` (see the module docstring).
        balloon: returns the framework's balloon controller, or None (no offload).

    Attributes:
        plan: the plan of the current grant.
        gate: the running gate, or None.
        parks: hand-overs at which memory was parked; ``parked_bytes`` / ``restored_bytes``:
            optimizer state moved to host memory and back at them.

    Raises:
        ConfigError: a mode or period out of range (naming the option).
    """

    def __init__(self, job: str, inbox: Any, *, mode: str = "auto", period_s: float = 2.0, offload: str = "auto",
                 balloon: Callable[[], Any] | None = None) -> None:
        if mode not in SHARING_MODES:
            raise ConfigError("sharing", f"got {mode!r}; use one of {', '.join(map(repr, SHARING_MODES))}")
        if offload not in OFFLOAD_MODES:
            raise ConfigError("handover_offload", f"got {offload!r}; use one of {', '.join(map(repr, OFFLOAD_MODES))}")
        from gpupool_sdk.client.timeslice import TimeSliceSettings

        try:
            self.settings = TimeSliceSettings(period_s=period_s)
        except ConfigError as exc:
            raise ConfigError("timeslice_period_s", str(exc).split(": ", 1)[-1]) from None
        self.job = job
        self.inbox = inbox
        self.mode = mode
        self.offload = offload
        self._balloon = balloon
        self.plan = SharingPlan()
        self.gate: Any = None
        self._connect: dict[str, Any] = {}
        self._parked: Any = None
        self._lock = threading.Lock()
        self._starting = False
        self._stopped = False
        self._started = threading.Event()
        self.parks = 0
        self.parked_bytes = 0
        self.restored_bytes = 0

    # -- the grant -------------------------------------------------------------------------
    def on_grant(self, allocations: Sequence[Allocation], node: str, gpus: Iterable[GpuInfo], *,
                 endpoints: Any = None, prefix: str | None = None, security: Any = None) -> SharingPlan:
        """A direct lease was granted: plan, and put the MPS environment into ``os.environ`` now."""
        self.plan = plan_sharing(allocations, node, gpus, enabled=self.mode != "off")
        self._connect = {"endpoints": endpoints, "prefix": prefix, "security": security}
        apply_environment(self.plan.env)
        self._log_plan()
        return self.plan

    def on_lease(self, lease: Any, client: Any) -> SharingPlan:
        """A direct lease: read the granted GPUs' records through the client, then :meth:`on_grant`.

        A lease or client that is not the SDK's (a test double without allocations) plans ``none``.
        """
        allocations = getattr(lease, "allocations", None)
        node = getattr(lease, "node", None)
        if not isinstance(allocations, tuple) or not isinstance(node, str) or not node:
            self.plan = SharingPlan()
            return self.plan
        gpus: list[GpuInfo] = []
        read = getattr(client, "gpus", None)
        if callable(read) and self.mode != "off":
            try:
                gpus = list(read(node))
            except GpupoolError as exc:
                log.warning("gpupool: could not read the GPU records of %s (%s); assuming no MPS", node, exc)
        keys = getattr(client, "keys", None)
        return self.on_grant(allocations, node, gpus, endpoints=getattr(client, "endpoints", None),
                             prefix=getattr(keys, "prefix", None), security=getattr(client, "security", None))

    def from_launcher(self, environ: Mapping[str, str] | None = None) -> SharingPlan:
        """Under ``gpupool run``: the launcher planned (and set the MPS environment); read its plan."""
        text = (os.environ if environ is None else environ).get(SHARING_ENV)
        plan = SharingPlan.from_env(text) if text else SharingPlan()
        if self.mode == "off" and plan.mechanism == "timeslice":
            plan = SharingPlan("none", plan.node)
        self.plan = plan
        self._connect = {}
        self._log_plan()
        return plan

    def _log_plan(self) -> None:
        p = self.plan
        if p.mechanism == "timeslice":
            log.info("gpupool: %s takes turns on %s with other jobs sharing it (time-slicing, share %g)",
                     self.job, p.gpu_uuid, p.compute_share)
            if p.ungated:
                log.warning("gpupool: %s also shares %s without MPS; one gate per job covers %s only, the others are "
                            "not enforced (use MPS for multi-GPU shared jobs)", self.job, ", ".join(p.ungated),
                            p.gpu_uuid)
        elif p.mechanism == "mps":
            log.info("gpupool: %s runs under CUDA MPS (%s)", self.job,
                     ", ".join(f"{k}={v}" for k, v in sorted(p.env.items())))

    # -- training --------------------------------------------------------------------------
    def start(self) -> None:
        """Training starts: run the gate when the plan says time-slicing. Never raises (logged).

        The keeper process starts on a thread of its own, so training starts at once; until the
        gate is up (about a second) the job's steps pass ungated.
        """
        with self._lock:
            if self._starting or self.gate is not None or self.plan.mechanism != "timeslice" or not self.plan.gpu_uuid:
                return
            self._starting, self._stopped = True, False
        threading.Thread(target=self._start_gate, name="gpupool-timeslice-start", daemon=True).start()

    def _start_gate(self) -> None:
        from gpupool_sdk.client.timeslice import TimeSliceGate

        gate = None
        try:
            gate = TimeSliceGate.start(
                self.job, self.plan.node, str(self.plan.gpu_uuid), compute_share=self.plan.compute_share,
                settings=self.settings, on_pause=self._on_pause, on_resume=self._on_resume,
                on_contention=self._on_contention, **{k: v for k, v in self._connect.items() if v is not None},
            )
        except GpupoolError as exc:
            log.warning("gpupool: %s could not start its time-slicing gate (%s); it runs without taking turns",
                        self.job, exc)
        with self._lock:
            self._starting = False
            if gate is not None and not self._stopped:
                self.gate = gate
                gate = None
            self._started.set()
        if gate is not None:  # training ended while the keeper was starting
            gate.close()

    def wait_started(self, timeout: float | None = None) -> bool:
        """Wait until the gate started (or failed to); True when it did within ``timeout``. For tests."""
        return self._started.wait(timeout)

    def turn(self) -> None:
        """At a step boundary while contended: returns at once in our quantum, else waits for our turn."""
        gate = self.gate
        if gate is not None:
            gate.step_boundary()

    def stop(self) -> None:
        """Training ends (finished, preempted, released): leave the rotation, restore parked memory."""
        with self._lock:
            self._stopped = True
            gate, self.gate = self.gate, None
        self.inbox.contended = False
        if gate is not None:
            try:
                gate.close()
            except Exception as exc:  # noqa: BLE001 - teardown goes on
                log.warning("gpupool: closing the time-slicing gate of %s failed: %s", self.job, exc)
        self._on_resume()

    @property
    def contended(self) -> bool:
        """True while another gated job shares the GPU (the gate takes turns)."""
        return bool(self.inbox.contended)

    # -- gate hooks ------------------------------------------------------------------------
    def _on_contention(self, contended: bool) -> None:
        # The reader thread of the gate: two attribute stores, read by the step boundary.
        self.inbox.contended = contended
        if contended:
            self.inbox.attention = True

    def _on_pause(self) -> None:
        gate = self.gate
        fits = gate.state.fits if gate is not None else None
        if self.offload == "never" or (self.offload == "auto" and fits is not False) or self._balloon is None:
            return
        try:
            ctl = self._balloon()
            if ctl is None or not hasattr(ctl, "park"):
                return
            res = ctl.park()
        except Exception as exc:  # noqa: BLE001 - a failed offload must not stop the hand-over
            log.warning("gpupool: %s could not park its memory at a hand-over: %s", self.job, exc)
            return
        self._parked = ctl
        self.parks += 1
        self.parked_bytes += int(getattr(res, "offloaded_bytes", 0))
        log.debug("gpupool: %s handed the GPU over: %s", self.job, getattr(res, "message", res))

    def _on_resume(self) -> None:
        ctl, self._parked = self._parked, None
        if ctl is None:
            return
        try:
            res = ctl.unpark()
        except Exception as exc:  # noqa: BLE001 - the optimizer's pre-step hook restores the state anyway
            log.warning("gpupool: %s could not restore its parked memory: %s", self.job, exc)
            return
        self.restored_bytes += int(getattr(res, "restored_bytes", 0))
