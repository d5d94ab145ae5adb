"""What a job asks for (:class:`JobSpec`) and where it stands (:class:`JobStatus`)."""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpupool_sdk.errors import SpecError
from gpupool_sdk.resources._fields import check, keyword_checked, opt, req, strings, unknown_field
from gpupool_sdk.resources.units import format_size, parse_size

_MIG_PROFILE_RE = re.compile(r"^(\d+c\.)?\d+g\.\d+gb(\+[a-z]+)?$")
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
#: node names as the keyspace accepts them (``store.keyspace``).
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")


class QoS(str, enum.Enum):
    """Quality-of-service class of a job.

    * ``exclusive``: whole GPUs, nobody else on them.
    * ``guaranteed``: memory and compute share reserved, never overcommitted.
    * ``shared``: best effort, preempted first, may be overcommitted within the operator's ratio.
    """

    EXCLUSIVE = "exclusive"
    GUARANTEED = "guaranteed"
    SHARED = "shared"

    @property
    def rank(self) -> int:
        """Protection rank: higher is preempted later (shared 0, guaranteed 1, exclusive 2)."""
        return {QoS.SHARED: 0, QoS.GUARANTEED: 1, QoS.EXCLUSIVE: 1}[self]


class Topology(str, enum.Enum):
    """Placement wish for a multi-GPU job: ``pack`` close together, ``spread`` over nodes, ``any``."""

    PACK = "pack"
    SPREAD = "spread"
    ANY = "any"


class JobState(str, enum.Enum):
    """The job state machine, written by the coordinator to ``jobs/{job}/status``."""

    PENDING = "PENDING"
    GRANTED = "GRANTED"
    PREEMPTING = "PREEMPTING"
    SUSPENDED = "SUSPENDED"
    DONE = "DONE"
    FAILED = "FAILED"
    REJECTED = "REJECTED"


def _enum(cls: type[enum.Enum], value: Any, field_name: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)  # type: ignore[var-annotated]
        raise SpecError(field_name, f"got {value!r}; use one of {allowed}") from None


def _canonical_model(name: str) -> str:
    """Map a catalog alias (``"h100"``, ``"A100"``) to the name agents publish (``"H100-80GB"``).

    A name the catalog does not know is kept as written: an NVML agent publishes a device the
    catalog lacks under its own NVML name, and a spec may ask for exactly that.
    """
    from gpupool_sdk.errors import UnknownGpuModelError
    from gpupool_sdk.inventory.catalog import lookup_model  # the catalog imports this package

    try:
        return lookup_model(name, "gpu_model").name
    except UnknownGpuModelError:
        return name


@keyword_checked
@dataclass(frozen=True)
class JobSpec:
    """What a training job asks of the pool.

    Args:
        name: unique job name (lowercase letters, digits, ``.``, ``_``, ``-``; at most 63).
            A job restarted under the same name resumes from its last acknowledged checkpoint.
        gpus: number of slices (one slice = a share of one GPU).
        memory: memory per slice, as bytes or a size string (``"20GiB"``). 0 with ``exclusive``
            means the whole GPU.
        compute_share: fraction of one GPU's compute per slice, in (0, 1].
        qos: ``exclusive``, ``guaranteed`` or ``shared``.
        priority: higher runs first and may preempt lower.
        features: capabilities every granted GPU must have (``bf16``, ``fp8``, ``nvlink``...).
        gpu_model: restrict to one catalog model (``"H100-80GB"``), or None for any.
        topology: ``pack`` (one NVLink island, else one node, else fewest nodes), ``spread``
            (distinct nodes) or ``any``.
        anti_affinity: jobs sharing this group name never share a node.
        min_gpus: elastic lower bound (defaults to ``gpus``).
        max_gpus: elastic upper bound (defaults to ``gpus``).
        min_runtime_s: minimum run time after a grant before the job may be preempted.
        preempt_grace_s: how long the job gets to checkpoint and ack a preempt directive.
        owner: team or user charged for the usage.
        node: the node whose GPUs the job must run on (a process uses only its own machine's
            GPUs). :meth:`PoolClient.acquire <gpupool_sdk.client.PoolClient.acquire>` fills it
            from the node-local agent (or ``$GPUPOOL_NODE``) when left None; a spec written with
            None by other means may be placed on any node. Not allowed with ``nodes`` > 1 (each
            gang member declares its own node when it joins).
        nodes: number of nodes of a multi-node gang (default 1). ``gpus`` is the total over
            all nodes and must be a multiple of ``nodes``: each node gets ``gpus // nodes``
            slices, granted all or nothing once every node's member joined
            (:meth:`PoolClient.join <gpupool_sdk.client.PoolClient.join>`). Gangs are rigid
            (no ``min_gpus`` / ``max_gpus``) and take whole nodes' parts: ``topology`` is ignored.
        mig_profile: run only on MIG GPU instances of this profile (``"3g.40gb"``, ``"1g.10gb"``,
            ``"1g.10gb+me"``, ``"1c.3g.40gb"``); each slice is then a share of one instance, under
            the same QoS rules as a share of a GPU (``qos="exclusive"`` takes the whole instance).
            None (the default): never placed on a MIG instance.

    Raises:
        SpecError: a field is invalid, or is not a field at all (a misspelt keyword such as
            ``preempt_grace=30`` names the closest valid one: ``preempt_grace_s``); the message
            names it and the fix.

    Example:
        >>> JobSpec(name="bert-ft", gpus=2, memory="30GiB", qos="guaranteed", priority=10).memory
        32212254720
    """

    name: str
    gpus: int = 1
    memory: int | str = 0
    compute_share: float = 1.0
    qos: QoS | str = QoS.GUARANTEED
    priority: int = 0
    features: tuple[str, ...] = ()
    gpu_model: str | None = None
    topology: Topology | str = Topology.PACK
    anti_affinity: str | None = None
    min_gpus: int | None = None
    max_gpus: int | None = None
    min_runtime_s: float = 0.0
    preempt_grace_s: float = 60.0
    owner: str = ""
    node: str | None = None
    nodes: int = 1
    mig_profile: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise SpecError(
                "name",
                f"{self.name!r} is not a valid job name; use 1-63 lowercase letters, digits, '.', '_' or '-', "
                "starting and ending with a letter or digit",
            )
        check(self.gpus, int, "gpus")
        if self.gpus < 1:
            raise SpecError("gpus", f"must be >= 1, got {self.gpus}")
        set_(self, "memory", parse_size(self.memory, "memory"))
        set_(self, "qos", _enum(QoS, self.qos, "qos"))
        set_(self, "topology", _enum(Topology, self.topology, "topology"))
        share = check(self.compute_share, float, "compute_share")
        if not 0.0 < share <= 1.0:
            raise SpecError("compute_share", f"must be in (0, 1], got {share}")
        if self.qos is QoS.EXCLUSIVE:
            if share != 1.0:
                raise SpecError("compute_share", "exclusive jobs take whole GPUs; leave compute_share at 1.0")
        elif self.memory == 0:
            raise SpecError(
                "memory", f"{self.qos_class.value} jobs must say how much memory per slice they need, e.g. memory='20GiB'"
            )
        set_(self, "compute_share", share)
        check(self.priority, int, "priority")
        set_(self, "features", tuple(sorted(set(strings(self.features, "features")))))
        min_g = self.gpus if self.min_gpus is None else check(self.min_gpus, int, "min_gpus")
        max_g = self.gpus if self.max_gpus is None else check(self.max_gpus, int, "max_gpus")
        if not 1 <= min_g <= self.gpus <= max_g:
            raise SpecError(
                "min_gpus", f"need 1 <= min_gpus <= gpus <= max_gpus, got {min_g} <= {self.gpus} <= {max_g}"
            )
        set_(self, "min_gpus", min_g)
        set_(self, "max_gpus", max_g)
        for name in ("min_runtime_s", "preempt_grace_s"):
            v = check(getattr(self, name), float, name)
            if not 0 <= v < math.inf:
                raise SpecError(name, f"must be a finite number of seconds >= 0, got {v}")
            set_(self, name, v)
        if self.anti_affinity is not None:
            check(self.anti_affinity, str, "anti_affinity")
        if self.gpu_model is not None:
            check(self.gpu_model, str, "gpu_model")
            set_(self, "gpu_model", _canonical_model(self.gpu_model))
        check(self.owner, str, "owner")
        self._check_nodes()
        if self.mig_profile is not None:
            check(self.mig_profile, str, "mig_profile")
            profile = self.mig_profile.strip().lower()
            if not _MIG_PROFILE_RE.match(profile):
                raise SpecError(
                    "mig_profile",
                    f"{self.mig_profile!r} is not a MIG profile; write it as nvidia-smi names GPU instance profiles, "
                    "e.g. '1g.10gb', '3g.40gb', '7g.80gb' or '1g.10gb+me' (`gpupool status` lists the instances in the pool)",
                )
            set_ = object.__setattr__
            set_(self, "mig_profile", profile)

    def _check_nodes(self) -> None:
        if self.node is not None:
            check(self.node, str, "node")
            if not _NODE_RE.match(self.node):
                raise SpecError("node", f"{self.node!r} is not a node name; use letters, digits, '.', '_', ':' or '-'")
        check(self.nodes, int, "nodes")
        if self.nodes < 1:
            raise SpecError("nodes", f"must be >= 1, got {self.nodes}")
        if self.nodes == 1:
            return
        if self.node is not None:
            raise SpecError("node", "a multi-node gang (nodes > 1) names no node: each member joins with its own")
        if self.gpus % self.nodes:
            raise SpecError(
                "gpus", f"a gang of {self.nodes} nodes needs gpus (the total) to be a multiple of nodes, got {self.gpus}; "
                f"for {max(1, self.gpus // self.nodes)} per node use gpus={max(1, self.gpus // self.nodes) * self.nodes}"
            )
        if self.is_elastic:
            raise SpecError("min_gpus", "a multi-node gang is rigid: leave min_gpus and max_gpus unset")

    # Typed views (the dataclass fields accept strings for convenience; after validation they are normalised).
    @property
    def memory_bytes(self) -> int:
        return int(self.memory)

    @property
    def qos_class(self) -> QoS:
        return QoS(self.qos)

    @property
    def topology_wish(self) -> Topology:
        return Topology(self.topology)

    @property
    def is_elastic(self) -> bool:
        return self.min_gpus != self.max_gpus

    @property
    def gpus_per_node(self) -> int:
        """Slices on each node of a gang (``gpus // nodes``; ``gpus`` for a one-node job)."""
        return self.gpus // self.nodes

    @property
    def is_gang(self) -> bool:
        """True for a multi-node gang (``nodes`` > 1)."""
        return self.nodes > 1

    def with_gpus(self, gpus: int) -> JobSpec:
        """The same spec asking for ``gpus`` slices (for elastic resizes)."""
        return replace(self, gpus=gpus)

    def describe(self) -> str:
        mem = "whole GPU" if self.memory_bytes == 0 else format_size(self.memory_bytes)
        if self.mig_profile is not None:
            mem = f"MIG {self.mig_profile}, " + ("whole instance" if self.memory_bytes == 0 else format_size(self.memory_bytes))
        shape = f"{self.nodes} nodes x {self.gpus_per_node}" if self.is_gang else str(self.gpus)
        where = f" on {self.node}" if self.node is not None else ""
        return f"{shape}x[{mem}, {self.compute_share:g} compute] {self.qos_class.value} prio={self.priority}{where}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "gpus": self.gpus,
            "memory_bytes": self.memory_bytes,
            "compute_share": self.compute_share,
            "qos": self.qos_class.value,
            "priority": self.priority,
            "features": list(self.features),
            "gpu_model": self.gpu_model,
            "topology": self.topology_wish.value,
            "anti_affinity": self.anti_affinity,
            "min_gpus": self.min_gpus,
            "max_gpus": self.max_gpus,
            "min_runtime_s": self.min_runtime_s,
            "preempt_grace_s": self.preempt_grace_s,
            "owner": self.owner,
            # Written only when set, so specs of one-node jobs read the same as before.
            **({"node": self.node} if self.node is not None else {}),
            **({"nodes": self.nodes} if self.nodes != 1 else {}),
            **({"mig_profile": self.mig_profile} if self.mig_profile is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "spec") -> JobSpec:
        unknown = set(d) - set(cls.__dataclass_fields__) - {"memory_bytes"}
        if unknown:
            name = sorted(unknown)[0]
            raise unknown_field(name, cls.__dataclass_fields__, "a job spec", field=f"{where}.{name}")
        memory = d.get("memory_bytes", d.get("memory", 0))
        return cls(
            name=req(d, "name", str, where),
            gpus=opt(d, "gpus", int, where, 1),
            memory=memory,
            compute_share=opt(d, "compute_share", float, where, 1.0),
            qos=opt(d, "qos", str, where, "guaranteed"),
            priority=opt(d, "priority", int, where, 0),
            features=tuple(opt(d, "features", list, where, [])),
            gpu_model=opt(d, "gpu_model", str, where, None),
            topology=opt(d, "topology", str, where, "pack"),
            anti_affinity=opt(d, "anti_affinity", str, where, None),
            min_gpus=opt(d, "min_gpus", int, where, None),
            max_gpus=opt(d, "max_gpus", int, where, None),
            min_runtime_s=opt(d, "min_runtime_s", float, where, 0.0),
            preempt_grace_s=opt(d, "preempt_grace_s", float, where, 60.0),
            owner=opt(d, "owner", str, where, ""),
            node=opt(d, "node", str, where, None),
            nodes=opt(d, "nodes", int, where, 1),
            mig_profile=opt(d, "mig_profile", str, where, None),
        )


@dataclass(frozen=True)
class Checkpoint:
    """The last checkpoint a job acknowledged: where it is and at which step."""

    path: str
    step: int
    at: float

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "step": self.step, "at": self.at}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "checkpoint") -> Checkpoint:
        return cls(path=req(d, "path", str, where), step=req(d, "step", int, where), at=req(d, "at", float, where))


@dataclass(frozen=True)
class JobStatus:
    """Where a job stands, written by the coordinator's leader.

    Attributes:
        state: the state machine position.
        reason: why it is there (``"queued: no GPU with 80GiB free"``, ``"preempted by job llm (prio 10)"``).
        updated_at: wall-clock time of the change.
        queued_at: when the job (this incarnation) was first seen pending.
        granted_at: when the current grant was made, else None.
        preemptions: how many times the job was preempted in its life.
        last_checkpoint: the last checkpoint the job acknowledged, kept across restarts.
        term: the leader term that wrote it.
        gpus: how many slices the current grant holds.
        attained_gpu_s: GPU-seconds of service received so far.
        resizes: how many elastic resizes the job went through in its life (counted apart from
            ``preemptions``: a resize keeps the job's lease and grant).
        resize_refusals: resize directives the job refused in a row (``ok=False`` acks); an
            accepted resize resets it.
        resize_retry_at: after a refused resize, the wall-clock time before which the scheduler
            proposes no resize to this job (a backoff that doubles with each refusal in a row);
            None when no refusal holds it back.
    """

    state: JobState
    reason: str = ""
    updated_at: float = 0.0
    queued_at: float = 0.0
    granted_at: float | None = None
    preemptions: int = 0
    last_checkpoint: Checkpoint | None = None
    term: int = 0
    gpus: int = 0
    attained_gpu_s: float = 0.0
    resizes: int = 0
    resize_refusals: int = 0
    resize_retry_at: float | None = None

    def wrote(self, granted_at: float | None) -> bool:
        """Whether an allocation carrying ``granted_at`` was written by this status's grant.

        Every allocation of a grant carries the grant's time, as its status does (a grant, a
        re-grant and a migration rewrite them all; a balloon, a deflate and a shrink keep it), so
        one whose time differs was written beside the grant (by hand, or left by a bug), and
        neither the leader (an orphan) nor the job (not a device of its) counts it. A status
        without a grant time (a coordinator older than the field) vouches for every allocation.
        """
        return self.granted_at is None or granted_at == self.granted_at

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "reason": self.reason,
            "updated_at": self.updated_at,
            "queued_at": self.queued_at,
            "granted_at": self.granted_at,
            "preemptions": self.preemptions,
            "last_checkpoint": self.last_checkpoint.to_dict() if self.last_checkpoint else None,
            "term": self.term,
            "gpus": self.gpus,
            "attained_gpu_s": self.attained_gpu_s,
            "resizes": self.resizes,
            "resize_refusals": self.resize_refusals,
            "resize_retry_at": self.resize_retry_at,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "status") -> JobStatus:
        ckpt = opt(d, "last_checkpoint", dict, where, None)
        return cls(
            state=_enum(JobState, req(d, "state", str, where), f"{where}.state"),
            reason=opt(d, "reason", str, where, ""),
            updated_at=opt(d, "updated_at", float, where, 0.0),
            queued_at=opt(d, "queued_at", float, where, 0.0),
            granted_at=opt(d, "granted_at", float, where, None),
            preemptions=opt(d, "preemptions", int, where, 0),
            last_checkpoint=Checkpoint.from_dict(ckpt, f"{where}.last_checkpoint") if ckpt else None,
            term=opt(d, "term", int, where, 0),
            gpus=opt(d, "gpus", int, where, 0),
            attained_gpu_s=opt(d, "attained_gpu_s", float, where, 0.0),
            # Written by newer leaders; absent (an older leader) reads as none.
            resizes=max(0, opt(d, "resizes", int, where, 0)),
            resize_refusals=max(0, opt(d, "resize_refusals", int, where, 0)),
            resize_retry_at=opt(d, "resize_retry_at", float, where, None),
        )


