"""Baseline policies run by the same engine as the pool's scheduler.

* :class:`FifoPolicy` (``fifo``): whole GPUs, no sharing, strict FIFO: the job at the head of
  the queue blocks everyone behind it (a stand-in for a YARN capacity scheduler queue).
* :class:`TiresiasPolicy` (``tiresias``): Tiresias' discretized two-dimensional
  least-attained-service (2D-LAS, NSDI'19): attained service = GPUs x executed time; jobs sit in
  queues cut at ``thresholds_gpu_s``, lower queue first, FIFO by arrival inside a queue; the
  most-deserving jobs that fit the cluster run and the others are preempted; a job that waited
  ``starve_ratio`` x its last run is promoted to the first queue. Whole GPUs, no sharing.
* :class:`BestFitPolicy` (``bestfit``): GPU sharing with best-fit packing (the fractional GPU's
  with the least leftover first) and no fragmentation awareness, no overcommit, no preemption;
  priority then FIFO order with backfilling. The comparison point for stranded GPUs (FGD's Best-fit).
* :class:`GandivaPolicy` (``gandiva``): Gandiva's time-slicing (OSDI'18): whole GPUs, and when
  the cluster is oversubscribed, jobs are suspended and resumed in place in round-robin quanta
  (cheap suspend-resume at mini-batch boundaries, not checkpoint preemption).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.scheduler.types import Decision, Grant, Preempt, SliceGrant
from gpupool_sdk.sim.engine import PENDING, PREEMPTING, RUNNING, SimJob, Simulator

EPS = 1e-9
#: a slice that ends within this many seconds of now has ended (event times are sums of floats).
_SLICE_TOL = 1e-6


def whole_gpu_grant(sim: Simulator, job: SimJob, gpus: Sequence[int]) -> Grant:
    """A grant of whole GPUs (all memory, all compute) to ``job``."""
    return Grant(
        job.name,
        tuple(
            SliceGrant(sim.node_of[g], sim.gpus[g].uuid, sim.gpus[g].index, sim.mem_total[g], 1.0) for g in gpus
        ),
        reason="whole GPUs",
    )


def pick_whole_gpus(sim: Simulator, count: int, taken: set[int]) -> list[int] | None:
    """Choose ``count`` idle GPUs: one node when possible (the one with the fewest idle GPUs that
    suffice, keeping big holes for big jobs), else the nodes with the most idle GPUs first."""
    by_node = [(len(free - taken), node) for node, free in sim.idle_by_node.items()]
    total = sum(n for n, _ in by_node)
    if total < count:
        return None
    fitting = [(n, node) for n, node in by_node if n >= count]
    if fitting:
        _, node = min(fitting)
        free = sorted(sim.idle_by_node[node] - taken)
        return free[:count]
    chosen: list[int] = []
    for _, node in sorted(by_node, key=lambda t: (-t[0], t[1])):
        for g in sorted(sim.idle_by_node[node] - taken):
            chosen.append(g)
            if len(chosen) == count:
                return chosen
    return None


class _Base:
    name = "base"
    uses_protocol = False
    overcommit_ratio = 1.0

    def bind(self, sim: Simulator) -> None:
        self.sim = sim

    def slice_demand(self, job: SimJob) -> tuple[float, int]:
        return 1.0, 0  # whole GPUs: any idle GPU hosts a slice

    def next_wakeup(self, sim: Simulator) -> float | None:
        return None


class FifoPolicy(_Base):
    """Strict FIFO on whole GPUs (no sharing, no preemption, no backfilling).

    Example:
        >>> FifoPolicy().name
        'fifo'
    """

    name = "fifo"

    def schedule(self, sim: Simulator) -> list[Decision]:
        out: list[Decision] = []
        taken: set[int] = set()
        # Pending jobs in arrival order (dicts keep insertion order; re-queued jobs go last, but
        # FIFO never preempts so each job is queued exactly once).
        for job in sim.pending.values():
            gpus = pick_whole_gpus(sim, job.num_gpu, taken)
            if gpus is None:
                break  # head-of-line blocking: nobody overtakes the head
            taken.update(gpus)
            out.append(whole_gpu_grant(sim, job, gpus))
        return out


class TiresiasPolicy(_Base):
    """Discretized 2D-LAS with starvation promotion, preemptive, whole GPUs.

    Args:
        thresholds_gpu_s: ascending queue thresholds on attained GPU-seconds (K = len + 1 queues).
        starve_ratio: a pending job that waited ``starve_ratio`` x its last run time is promoted
            to the first queue (its attained service for queueing restarts from there); 0 disables.

    Example:
        >>> TiresiasPolicy(thresholds_gpu_s=(3600.0,)).name
        'tiresias'
    """

    name = "tiresias"

    def __init__(self, thresholds_gpu_s: Sequence[float] = (3600.0,), starve_ratio: float = 8.0) -> None:
        ts = tuple(float(t) for t in thresholds_gpu_s)
        if any(t <= 0 for t in ts) or list(ts) != sorted(set(ts)):
            raise ConfigError("thresholds_gpu_s", f"must be strictly ascending positive GPU-seconds, got {thresholds_gpu_s}")
        if starve_ratio < 0:
            raise ConfigError("starve_ratio", f"must be >= 0, got {starve_ratio}")
        self.thresholds = ts
        self.starve_ratio = starve_ratio
        self._offset: dict[int, float] = {}  # attained GPU-s at the last promotion, per job
        self._pkey: dict[int, tuple[int, float, int]] = {}  # pending job -> its sort key
        self._psorted: list[tuple[int, float, int]] = []  # pending keys, sorted
        self._promo: list[tuple[float, int, float]] = []  # (promotion time, job, queued_since)

    def bind(self, sim: Simulator) -> None:
        self.sim = sim
        sim.listeners.append(self._on_change)

    def _on_change(self, job: SimJob) -> None:
        pending = job.state == PENDING
        key = self._pkey.get(job.index)
        if pending and key is None:
            self._insert(job)
            if self.starve_ratio > 0 and job.last_run_s > 0:
                heapq.heappush(
                    self._promo, (job.queued_since + self.starve_ratio * job.last_run_s, job.index, job.queued_since)
                )
        elif not pending and key is not None:
            self._remove(job.index)

    def _insert(self, job: SimJob) -> None:
        key = (self.queue_of(job, self.sim.now), job.submit, job.index)
        self._pkey[job.index] = key
        bisect.insort(self._psorted, key)

    def _remove(self, index: int) -> None:
        key = self._pkey.pop(index)
        i = bisect.bisect_left(self._psorted, key)
        del self._psorted[i]

    def _attained(self, job: SimJob, now: float) -> float:
        att = job.attained_gpu_s
        if job.state == RUNNING:
            att += (now - job.last) * job.num_gpu
        return att - self._offset.get(job.index, 0.0)

    def queue_of(self, job: SimJob, now: float) -> int:
        """The LAS queue of ``job`` now (0 = least attained service)."""
        # A tolerance so that a job woken exactly at its crossing time is already demoted.
        return bisect.bisect_right(self.thresholds, self._attained(job, now) + 1e-6)

    def _promote(self, sim: Simulator) -> None:
        while self._promo and self._promo[0][0] <= sim.now:
            _, idx, since = heapq.heappop(self._promo)
            job = sim.jobs[idx]
            if job.state == PENDING and job.queued_since == since and idx in self._pkey:
                self._offset[idx] = job.attained_gpu_s
                self._remove(idx)
                self._insert(job)

    def schedule(self, sim: Simulator) -> list[Decision]:
        now = sim.now
        self._promote(sim)
        running = sorted(
            (self.queue_of(j, now), j.submit, j.index) for j in sim.running.values() if j.state == RUNNING
        )
        budget = sum(1 for h in sim.healthy if h)
        selected: list[SimJob] = []
        for _, _, idx in heapq.merge(running, self._psorted):
            job = sim.jobs[idx]
            if job.num_gpu <= budget:
                selected.append(job)
                budget -= job.num_gpu
                if budget == 0:
                    break
        chosen = {j.index for j in selected}
        out: list[Decision] = []
        for job in sim.running.values():
            if job.state == RUNNING and job.index not in chosen:
                out.append(Preempt(job.name, "tiresias: a job in a lower LAS queue needs the GPUs", now))
        taken: set[int] = set()
        for job in selected:
            if job.state == PENDING:
                if job.num_gpu > len(sim.idle) - len(taken):
                    continue  # wait for the preempted jobs to release
                gpus = pick_whole_gpus(sim, job.num_gpu, taken)
                if gpus is None:
                    continue
                taken.update(gpus)
                out.append(whole_gpu_grant(sim, job, gpus))
        return out

    def next_wakeup(self, sim: Simulator) -> float | None:
        now = sim.now
        best: float | None = None
        for job in sim.running.values():
            if job.state != RUNNING:
                continue
            att = self._attained(job, now)
            q = bisect.bisect_right(self.thresholds, att + 1e-6)
            if q < len(self.thresholds):
                t = now + (self.thresholds[q] - att) / job.num_gpu
                best = t if best is None else min(best, t)
        while self._promo:
            t, idx, since = self._promo[0]
            job = sim.jobs[idx]
            if job.state == PENDING and job.queued_since == since:
                if t > now:
                    best = t if best is None else min(best, t)
                break
            heapq.heappop(self._promo)
        return best


class BestFitPolicy(_Base):
    """GPU sharing with best-fit packing, no overcommit, no preemption, backfilling.

    Each job asks ``gpu_fraction`` of a GPU's compute and its memory demand per slice (whole-GPU
    jobs ask the whole GPU). Jobs are taken by priority class then arrival; a job that does not
    fit is skipped (backfilling). A fractional slice goes to the shared GPU with the least
    leftover compute that still fits, else to an idle GPU.

    Example:
        >>> BestFitPolicy().name
        'bestfit'
    """

    name = "bestfit"
    _min_fraction = 0.0

    def bind(self, sim: Simulator) -> None:
        self.sim = sim
        self._min_fraction = min((j.fraction for j in sim.jobs), default=1.0) - EPS

    def slice_demand(self, job: SimJob) -> tuple[float, int]:
        if job.fraction >= 1.0:
            return 1.0, 0
        return job.fraction, job.demand

    def schedule(self, sim: Simulator) -> list[Decision]:
        out: list[Decision] = []
        taken: set[int] = set()
        extra_share: dict[int, float] = {}
        extra_mem: dict[int, int] = {}
        pend = sorted(sim.pending.values(), key=lambda j: (-_prio_rank(j.tj.priority), j.queued_since, j.index))
        partial = [g for g in range(len(sim.gpus)) if sim.on_gpu[g] and sim.healthy[g] and sim.alloc_share[g] < 1 - EPS]
        max_free = max((1.0 - sim.alloc_share[g] for g in partial), default=0.0)
        for job in pend:
            idle_left = len(sim.idle) - len(taken)
            if idle_left == 0 and max_free < self._min_fraction:
                break  # nothing can fit any more
            if job.fraction >= 1.0:
                if job.num_gpu > idle_left:
                    continue
                gpus = pick_whole_gpus(sim, job.num_gpu, taken)
                if gpus is None:
                    continue
                taken.update(gpus)
                out.append(whole_gpu_grant(sim, job, gpus))
                continue
            share, mem = job.fraction, job.demand
            if idle_left == 0 and share > max_free + EPS:
                continue
            best = -1
            best_left = 2.0
            for g in partial:
                left = 1.0 - sim.alloc_share[g] - extra_share.get(g, 0.0) - share
                if left < -EPS or left >= best_left:
                    continue
                if sim.mem_total[g] - sim.alloc_mem[g] - extra_mem.get(g, 0) < mem:
                    continue
                best, best_left = g, left
            if best < 0:
                idle = pick_whole_gpus(sim, 1, taken)
                if idle is None:
                    continue
                best = idle[0]
                taken.add(best)
                partial.append(best)
            extra_share[best] = extra_share.get(best, 0.0) + share
            max_free = max(max_free, 1.0 - sim.alloc_share[best] - extra_share[best])
            extra_mem[best] = extra_mem.get(best, 0) + mem
            g = best
            out.append(
                Grant(job.name, (SliceGrant(sim.node_of[g], sim.gpus[g].uuid, sim.gpus[g].index, mem, share),), "best fit")
            )
        return out


class GandivaPolicy(_Base):
    """Gandiva-style time-slicing on whole GPUs (Xiao et al., OSDI'18), without packing or migration.

    Every job gets ``num_gpu`` whole GPUs (a fractional row takes whole GPUs, as under ``fifo``).
    While everything fits, jobs start on arrival and run to completion: the schedule is FIFO's.
    When jobs want more GPUs than the cluster has, the GPUs are time-sliced: all jobs that want
    GPUs form one round-robin queue (arrivals and suspended jobs join at the tail), and a running
    job whose current slice has lasted ``quantum_s`` is suspended when the jobs at the head of the
    queue need its GPUs; the longest-running slices are suspended first, and only as many GPUs as
    the head of the queue can use are freed (the head must fit the cluster together with the
    slices that have not expired yet). The head is served first, nobody overtakes it (a gang
    waits until enough slices expire). So a job that arrives waits at most one *round*: one
    quantum (plus the suspend and resume costs) for every ``number of GPUs`` GPUs wanted by the
    jobs ahead of it.

    A suspension is Gandiva's suspend-resume, not a checkpoint: the job stops at a mini-batch
    boundary, where its GPU memory is smallest, and that memory is copied to host memory. The
    engine models it through the policy's ``suspend_s`` (from the directive to the freed GPUs,
    no progress) and ``resume_s`` (extra work at the next grant), which replace the checkpoint
    and restart costs; a GPU failure still costs a full restart. Suspensions are counted as
    preemptions.

    Modelled: whole-GPU gangs, time-slicing in round-robin quanta, suspend/resume costs. A
    resumed job goes back to its previous GPUs when they are all free, else to any free GPUs
    (Gandiva resumes in place and moves jobs only by migration, which costs a checkpoint; that
    cost is not charged, the count is kept in :attr:`resumed_elsewhere`). Not modelled: packing
    of low-utilization jobs on one GPU, migration for locality or defragmentation, introspective
    profiling (the throughput feedback that drives Gandiva's packing and migration decisions),
    intra-job elasticity (grow/shrink), priorities and the per-GPU affinity queues.

    Args:
        quantum_s: length of a time slice, seconds. Default 60 s, Gandiva's slice length.
        suspend_s: suspend cost: from the suspend directive to the freed GPUs (finish the current
            mini-batch, copy GPU memory to host), no progress. Default 0.5 s.
        resume_s: resume cost: extra work at the next grant (copy memory back). Default 0.5 s;
            1 s per switch in all, the high end of Gandiva's sub-second suspend-resume, against
            30 s for the engine's default checkpoint preemption.

    Raises:
        ConfigError: a non-positive quantum or a negative (or non-finite) cost; names the argument.

    Example:
        >>> GandivaPolicy(quantum_s=60.0).name
        'gandiva'
    """

    name = "gandiva"

    def __init__(self, quantum_s: float = 60.0, suspend_s: float = 0.5, resume_s: float = 0.5) -> None:
        if not (quantum_s > 0 and math.isfinite(quantum_s)):
            raise ConfigError("quantum_s", f"must be a finite number of seconds > 0, got {quantum_s}")
        for arg, v in (("suspend_s", suspend_s), ("resume_s", resume_s)):
            if not (v >= 0 and math.isfinite(v)):
                raise ConfigError(arg, f"must be a finite number of seconds >= 0, got {v}")
        self.quantum_s = float(quantum_s)
        self.suspend_s = float(suspend_s)
        self.resume_s = float(resume_s)
        #: resumes that could not go back to the job's previous GPUs (a migration Gandiva would pay for).
        self.resumed_elsewhere = 0
        self._last_gpus: dict[int, list[int]] = {}

    def bind(self, sim: Simulator) -> None:
        self.sim = sim
        self.resumed_elsewhere = 0
        self._last_gpus = {}
        sim.listeners.append(self._on_change)

    def _on_change(self, job: SimJob) -> None:
        if job.state == RUNNING and job.gpus:
            self._last_gpus[job.index] = job.gpus
        elif job.state not in (PENDING, PREEMPTING):
            self._last_gpus.pop(job.index, None)

    def schedule(self, sim: Simulator) -> list[Decision]:
        out: list[Decision] = []
        if not sim.pending:
            return out
        now = sim.now
        running = [j for j in sim.running.values() if j.state == RUNNING]
        expired = [j for j in running if now - j.granted_at >= self.quantum_s - _SLICE_TOL]
        if expired:
            # GPUs the head of the round-robin queue can use this round: the cluster less the
            # slices that have not expired (they keep their GPUs until their quantum ends).
            healthy = sum(1 for h in sim.healthy if h)
            budget = healthy - sum(j.num_gpu for j in running if now - j.granted_at < self.quantum_s - _SLICE_TOL)
            wanted = 0
            for job in sim.pending.values():
                if wanted + job.num_gpu > budget:
                    break
                wanted += job.num_gpu
            freeing = sum(len(j.gpus) for j in sim.running.values() if j.state == PREEMPTING)
            need = wanted - len(sim.idle) - freeing
            if need > 0:
                expired.sort(key=lambda j: (j.granted_at, j.index))
                for job in expired:
                    if need <= 0:
                        break
                    out.append(Preempt(job.name, "gandiva: time slice over, jobs wait", now))
                    need -= job.num_gpu
        taken: set[int] = set()
        for job in sim.pending.values():
            prev = self._last_gpus.get(job.index)
            if prev is not None and all(g in sim.idle and g not in taken for g in prev):
                gpus: list[int] | None = list(prev)
            else:
                gpus = pick_whole_gpus(sim, job.num_gpu, taken)
                if gpus is not None and prev is not None:
                    self.resumed_elsewhere += 1
            if gpus is None:
                break  # round-robin order: nobody overtakes the head
            taken.update(gpus)
            out.append(whole_gpu_grant(sim, job, gpus))
        return out

    def next_wakeup(self, sim: Simulator) -> float | None:
        if not sim.pending:
            return None
        now = sim.now
        ends = [
            j.granted_at + self.quantum_s
            for j in sim.running.values()
            if j.state == RUNNING and j.granted_at + self.quantum_s > now + _SLICE_TOL
        ]
        return min(ends) if ends else None


def _prio_rank(priority: str) -> int:
    return {"guaranteed": 3, "ls": 2, "burstable": 1, "be": 0}.get(priority.strip().lower(), 1)
