"""Record types stored by the pool that are not part of the resource model.

* :class:`ResumeRecord` (``checkpoints/{job}``, written by the leader, no lease): what a job
  restarted under the same name resumes from.
* :class:`TelemetryRecord` (``telemetry/{job}``, written by the client, on the job's lease): the
  job's latest phase-aware summary.
* :class:`JobResult` (``results/{job}``, written by ``gpupool run`` on a lease of the retention
  time): how the job's last run ended, so that ``gpupool status`` lists FAILED jobs after their
  own keys are gone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpupool_sdk.resources import Checkpoint
from gpupool_sdk.resources._fields import opt, req


def _estimate(value: float | None) -> float | None:
    # A remaining-time estimate below zero (hand-edited) reads as none, like telemetry's.
    return value if value is not None and value >= 0 else None


@dataclass(frozen=True)
class ResumeRecord:
    """The value of ``checkpoints/{job}``: kept across restarts of a job of the same name.

    Attributes:
        job: the job name.
        last_checkpoint: the last checkpoint the job acknowledged, or None.
        preemptions: how many times the job was preempted in its life.
        resizes: how many elastic resizes it went through in its life (counted apart from
            preemptions; the status of a job restarted under the same name starts from it).
        first_queued_at: wall-clock time the job was first queued (keeps its aging credit).
        attained_gpu_s: GPU-seconds of service received so far.
        remaining_s: the remaining-time estimate the job last published (telemetry ``remaining_s``)
            before it was preempted, None when it published none. The job's telemetry key goes
            with its lease, and a queued job publishes nothing, so the snapshot ranks a job queued
            again by this value until it publishes a new one (without it, a preempted job would
            be ranked by attained service while it waits and by remaining service once it runs,
            and two such jobs preempt each other back and forth).
        order: after a preemption, the job's place in submission order (``JobView.order``: the
            etcd create revision of its first spec), so that the job queued again keeps its FIFO
            place among equals, as in Tiresias and the simulator (and stays the older one when
            victims tie); 0 otherwise (a job submitted again after it ended queues as new).
    """

    job: str
    last_checkpoint: Checkpoint | None = None
    preemptions: int = 0
    first_queued_at: float = 0.0
    attained_gpu_s: float = 0.0
    remaining_s: float | None = None
    resizes: int = 0
    order: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "last_checkpoint": self.last_checkpoint.to_dict() if self.last_checkpoint else None,
            "preemptions": self.preemptions,
            "first_queued_at": self.first_queued_at,
            "attained_gpu_s": self.attained_gpu_s,
            "remaining_s": self.remaining_s,
            "resizes": self.resizes,
            "order": self.order,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "checkpoint") -> ResumeRecord:
        # Unknown fields are ignored so that the leader may add some without breaking old clients.
        ckpt = opt(d, "last_checkpoint", dict, where, None)
        return cls(
            job=req(d, "job", str, where),
            last_checkpoint=Checkpoint.from_dict(ckpt, f"{where}.last_checkpoint") if ckpt else None,
            preemptions=opt(d, "preemptions", int, where, 0),
            first_queued_at=opt(d, "first_queued_at", float, where, 0.0),
            attained_gpu_s=opt(d, "attained_gpu_s", float, where, 0.0),
            remaining_s=_estimate(opt(d, "remaining_s", float, where, None)),
            resizes=max(0, opt(d, "resizes", int, where, 0)),
            order=max(0, opt(d, "order", int, where, 0)),
        )


@dataclass(frozen=True)
class TelemetryRecord:
    """The value of ``telemetry/{job}``: the job's latest summary (shape owned by the telemetry module).

    Attributes:
        job: the job name.
        at: wall-clock time the summary was taken.
        summary: JSON-compatible mapping (phase times, utilisation, memory peak bytes...).
    """

    job: str
    at: float
    summary: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "at": self.at, "summary": dict(self.summary)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "telemetry") -> TelemetryRecord:
        return cls(job=req(d, "job", str, where), at=opt(d, "at", float, where, 0.0), summary=opt(d, "summary", dict, where, {}))


#: Result states a launcher records.
RESULT_STATES = ("DONE", "FAILED")


@dataclass(frozen=True)
class JobResult:
    """The value of ``results/{job}``: how the job's last run ended.

    Attributes:
        job: the job name.
        state: ``"DONE"`` or ``"FAILED"``.
        exit_code: the launcher's exit code (128+N for a death by signal N).
        reason: what happened (``"killed by SIGKILL after 4 attempts"``).
        attempts: how many times the script ran.
        finished_at: wall-clock time it ended.
    """

    job: str
    state: str
    exit_code: int = 0
    reason: str = ""
    attempts: int = 1
    finished_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "state": self.state, "exit_code": self.exit_code, "reason": self.reason,
                "attempts": self.attempts, "finished_at": self.finished_at}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "result") -> JobResult:
        from gpupool_sdk.errors import SpecError

        state = req(d, "state", str, where)
        if state not in RESULT_STATES:
            raise SpecError(f"{where}.state", f"must be one of {', '.join(RESULT_STATES)}, got {state!r}")
        return cls(job=req(d, "job", str, where), state=state, exit_code=opt(d, "exit_code", int, where, 0),
                   reason=opt(d, "reason", str, where, ""), attempts=opt(d, "attempts", int, where, 1),
                   finished_at=opt(d, "finished_at", float, where, 0.0))
