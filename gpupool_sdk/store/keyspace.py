"""Every etcd key of the pool, built in one place.

Layout under the prefix (default ``/gpupool/v1``)::

    nodes/{node}                          agent, on the agent's lease
    gpus/{node}/{gpu_uuid}                agent, on the agent's lease
    readings/{node}/{gpu_uuid}            agent, on the agent's lease (usage readings; the coordinator neither reads nor watches them)
    cordons/{gpu_uuid}                    operator (gpupool cordon), no lease
    drains/{node}                         operator (gpupool drain), no lease
    jobs/{job}/spec                       client, on the job's lease
    jobs/{job}/status                     leader, on the job's lease
    jobs/{job}/owner                      client, on the job's lease (host and pids holding it)
    jobs/{job}/members/{node}             gang member on that node (PoolClient.join), on the member's own lease
    allocations/{node}/{gpu_uuid}/{job}   leader, on the job's lease
    directives/{job}                      leader, on the job's lease
    acks/{job}                            client, on the job's lease
    telemetry/{job}                       client, on the job's lease
    leader                                leader, on the coordinator's lease
    term                                  leader, no lease (the last term handed out; terms only grow)
    checkpoints/{job}                     leader, no lease (survives the job, for resume)
    usage/{job}                           leader, no lease (cost accounting)
    timeslice/{node}/{gpu_uuid}/turn      time-slicing keeper of the holding job, on its own lease
    timeslice/{node}/{gpu_uuid}/members/{job}  time-slicing keeper of each gated job, on its own lease
    autoscale                             leader, no lease (desired node count per GPU type)
    prices                                leader, no lease (the price table usage is charged with; once per term)
    results/{job}                         gpupool run, on a retention lease of its own (how the job's last run ended)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from gpupool_sdk.errors import ConfigError

DEFAULT_PREFIX = "/gpupool/v1"
PREFIX_ENV = "GPUPOOL_PREFIX"
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")


def _seg(value: str, what: str) -> str:
    if not _SEGMENT_RE.match(value):
        raise ConfigError(what, f"{value!r} cannot be used in an etcd key; use letters, digits, '.', '_', ':' or '-'")
    return value


@dataclass(frozen=True)
class ParsedKey:
    """A key split into its kind (``"gpus"``, ``"jobs.spec"``...) and its name parts."""

    kind: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class Keyspace:
    """Builds and parses the pool's etcd keys under one prefix.

    Args:
        prefix: key prefix, default ``/gpupool/v1`` (or ``$GPUPOOL_PREFIX``). Must start with ``/``.

    Example:
        >>> Keyspace().job_spec("bert")
        '/gpupool/v1/jobs/bert/spec'
    """

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        p = self.prefix.rstrip("/")
        if not p.startswith("/") or "//" in p or len(p) < 2:
            raise ConfigError("prefix", f"{self.prefix!r} must be an absolute key path such as '/gpupool/v1'")
        object.__setattr__(self, "prefix", p)

    @classmethod
    def from_env(cls, prefix: str | None = None) -> Keyspace:
        return cls(prefix or os.environ.get(PREFIX_ENV) or DEFAULT_PREFIX)

    def _k(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    # Whole-pool prefix.
    def root(self) -> str:
        return self.prefix + "/"

    # Nodes and GPUs (agent).
    def node(self, node: str) -> str:
        return self._k("nodes", _seg(node, "node"))

    def nodes_prefix(self) -> str:
        return self._k("nodes", "")

    def gpu(self, node: str, gpu_uuid: str) -> str:
        return self._k("gpus", _seg(node, "node"), _seg(gpu_uuid, "gpu_uuid"))

    def gpus_prefix(self, node: str | None = None) -> str:
        return self._k("gpus", _seg(node, "node"), "") if node else self._k("gpus", "")

    # Per-GPU usage readings (agent): apart from the GPU record, so that their churn is no scheduler input.
    def readings(self, node: str, gpu_uuid: str) -> str:
        return self._k("readings", _seg(node, "node"), _seg(gpu_uuid, "gpu_uuid"))

    def readings_prefix(self, node: str | None = None) -> str:
        return self._k("readings", _seg(node, "node"), "") if node else self._k("readings", "")

    # Operator intents.
    def cordon(self, gpu_uuid: str) -> str:
        return self._k("cordons", _seg(gpu_uuid, "gpu_uuid"))

    def cordons_prefix(self) -> str:
        return self._k("cordons", "")

    def drain(self, node: str) -> str:
        return self._k("drains", _seg(node, "node"))

    def drains_prefix(self) -> str:
        return self._k("drains", "")

    # Jobs.
    def job_spec(self, job: str) -> str:
        return self._k("jobs", _seg(job, "job"), "spec")

    def job_status(self, job: str) -> str:
        return self._k("jobs", _seg(job, "job"), "status")

    def job_owner(self, job: str) -> str:
        return self._k("jobs", _seg(job, "job"), "owner")

    def jobs_prefix(self) -> str:
        return self._k("jobs", "")

    def job_member(self, job: str, node: str) -> str:
        return self._k("jobs", _seg(job, "job"), "members", _seg(node, "node"))

    def job_members_prefix(self, job: str) -> str:
        return self._k("jobs", _seg(job, "job"), "members", "")

    def allocation(self, node: str, gpu_uuid: str, job: str) -> str:
        return self._k("allocations", _seg(node, "node"), _seg(gpu_uuid, "gpu_uuid"), _seg(job, "job"))

    def allocations_prefix(self, node: str | None = None, gpu_uuid: str | None = None) -> str:
        """Every allocation; of ``node``; or of one GPU of it (ends with ``/``: GPU-1 is not GPU-10)."""
        if node and gpu_uuid:
            return self._k("allocations", _seg(node, "node"), _seg(gpu_uuid, "gpu_uuid"), "")
        return self._k("allocations", _seg(node, "node"), "") if node else self._k("allocations", "")

    def directive(self, job: str) -> str:
        return self._k("directives", _seg(job, "job"))

    def directives_prefix(self) -> str:
        return self._k("directives", "")

    def ack(self, job: str) -> str:
        return self._k("acks", _seg(job, "job"))

    def acks_prefix(self) -> str:
        return self._k("acks", "")

    def telemetry(self, job: str) -> str:
        return self._k("telemetry", _seg(job, "job"))

    def telemetry_prefix(self) -> str:
        return self._k("telemetry", "")

    def checkpoint(self, job: str) -> str:
        return self._k("checkpoints", _seg(job, "job"))

    def checkpoints_prefix(self) -> str:
        return self._k("checkpoints", "")

    def usage(self, job: str) -> str:
        return self._k("usage", _seg(job, "job"))

    def usage_prefix(self) -> str:
        return self._k("usage", "")

    # How a job's last run under `gpupool run` ended (FAILED, DONE), on a retention lease of its own.
    def result(self, job: str) -> str:
        return self._k("results", _seg(job, "job"))

    def results_prefix(self) -> str:
        return self._k("results", "")

    # Step-level time-slicing (client/timeslice_keeper.py).
    def timeslice_prefix(self, node: str, gpu_uuid: str) -> str:
        return self._k("timeslice", _seg(node, "node"), _seg(gpu_uuid, "gpu_uuid"), "")

    def timeslice_turn(self, node: str, gpu_uuid: str) -> str:
        return self._k("timeslice", _seg(node, "node"), _seg(gpu_uuid, "gpu_uuid"), "turn")

    def timeslice_member(self, node: str, gpu_uuid: str, job: str) -> str:
        return self._k("timeslice", _seg(node, "node"), _seg(gpu_uuid, "gpu_uuid"), "members", _seg(job, "job"))

    def timeslice_all_prefix(self) -> str:
        return self._k("timeslice", "")

    # Autoscale signal (scheduler/autoscale.py, written by the leader).
    def autoscale(self) -> str:
        return self._k("autoscale")

    # The operator's prices the leader accrues with (written by the leader each term).
    def prices(self) -> str:
        return self._k("prices")

    # Coordinator.
    def leader(self) -> str:
        return self._k("leader")

    def term(self) -> str:
        return self._k("term")

    def parse(self, key: str) -> ParsedKey | None:
        """Split a key of this keyspace; None for a key outside it or of unknown shape."""
        if not key.startswith(self.prefix + "/"):
            return None
        parts = tuple(key[len(self.prefix) + 1 :].split("/"))
        head, rest = parts[0], parts[1:]
        shapes = {
            "nodes": 1,
            "gpus": 2,
            "readings": 2,
            "cordons": 1,
            "drains": 1,
            "allocations": 3,
            "directives": 1,
            "acks": 1,
            "telemetry": 1,
            "checkpoints": 1,
            "usage": 1,
            "results": 1,
        }
        if head in ("leader", "term", "autoscale", "prices") and not rest:
            return ParsedKey(head, ())
        if head == "timeslice" and len(rest) == 3 and rest[2] == "turn" and all(rest):
            return ParsedKey("timeslice.turn", rest[:2])
        if head == "timeslice" and len(rest) == 4 and rest[2] == "members" and all(rest):
            return ParsedKey("timeslice.member", (rest[0], rest[1], rest[3]))
        if head == "jobs" and len(rest) == 3 and rest[1] == "members" and rest[0] and rest[2]:
            return ParsedKey("jobs.member", (rest[0], rest[2]))
        if head == "jobs" and len(rest) == 2 and rest[1] in ("spec", "status", "owner"):
            return ParsedKey(f"jobs.{rest[1]}", (rest[0],))
        if head in shapes and len(rest) == shapes[head] and all(rest):
            return ParsedKey(head, rest)
        return None
