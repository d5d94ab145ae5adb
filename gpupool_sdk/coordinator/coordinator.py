"""The coordinator: one decision loop over an immutable snapshot, in the manner of Patroni's ``ha.py``.

Every replica runs the same loop. A watch on the whole pool prefix wakes it on any change (but
for keys only other parties read; the agents' usage readings, ``readings/{node}/{gpu}``, are
neither watched nor read: the store drops them from the watch and the read); it also wakes every
``loop_wait_s`` (and at the earliest directive deadline), because deadlines and
minimum run times pass without any key changing. Each wake-up:

1. **Election step.** A standby campaigns when the leader key is absent; the leader renews at
   most every ``loop_wait_s`` (and steps down when it cannot renew in time).
2. **Cycle** (leader only, one at a time): read the whole prefix but the readings at one revision
   (:func:`~gpupool_sdk.coordinator.snapshot.build_state`), run the pure
   :class:`~gpupool_sdk.scheduler.policy.Scheduler`, apply its decisions through the
   :class:`~gpupool_sdk.coordinator.apply.Applier`, fenced on the leader key. A cycle whose
   scheduler input is unchanged but for the clock (no key the snapshot is built from was written
   or deleted since the last scheduled read, same term) before that cycle's
   ``ScheduleResult.valid_until`` (:mod:`~gpupool_sdk.scheduler.horizon`) is **skipped**: the
   scheduler would decide what was just applied. Usage, orphans and autoscale still run.
3. **Usage.** Accrue GPU-seconds and cost of every held slice into the
   :class:`~gpupool_sdk.telemetry.usage.UsageLedger`; flush changed ``usage/{job}`` records
   (fenced) every ``usage_flush_s`` and whenever a job gives its slices back. Each job is charged
   from its grant (``Allocation.granted_at``) to the cycle that sees its slices released, changed
   or gone; running jobs are charged once a second. Accounting runs after the cycle's writes, so
   it never delays a grant. After a failover the new leader charges running jobs from where their
   ``usage/{job}`` record ends; only a job that ended before the new leader saw it loses what the
   old leader had not flushed yet (at most ``usage_flush_s``).

4. **Orphans.** A leader-owned job key that belongs to no live job (no lease, no valid spec, or
   an earlier incarnation's lease; see :mod:`~gpupool_sdk.coordinator.snapshot`) is counted as
   used by the scheduler and deleted by the leader once it has seen it unchanged for
   ``orphan_grace_s``, in a transaction fenced on the leader key and on the key's mod revision.

Every transaction fits etcd's ``--max-txn-ops``: ``SchedulerConfig.etcd_max_txn_ops`` (0 there
means :data:`DEFAULT_ETCD_MAX_TXN_OPS`, etcd's own default) must match etcd's flag. The scheduler
rejects gangs that could outgrow it and the applier checks every plan against it (see
:mod:`~gpupool_sdk.coordinator.apply`); usage flushes are chunked to fit.

SIGTERM (through :meth:`Coordinator.stop`) ends the loop and resigns at once: the leader key is
deleted under the fence and the lease revoked, so a standby takes over without waiting a TTL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator.apply import Applier, ApplyReport
from gpupool_sdk.coordinator.election import Election, ElectionTiming
from gpupool_sdk.coordinator.fencing import Absent, DeleteOp, FencedWriter, Guard, PutOp, Unchanged
from gpupool_sdk.coordinator.snapshot import DecodeCache, PoolState, build_state
from gpupool_sdk.errors import ConfigError, GpupoolError, NotLeaderError, SpecError, StoreError
from gpupool_sdk.resources import Allocation
from gpupool_sdk.scheduler import types as st
from gpupool_sdk.scheduler.autoscale import Autoscaler, AutoscaleSettings, AutoscaleSignal
from gpupool_sdk.scheduler.types import SchedulerConfig, SliceGrant
from gpupool_sdk.store import EtcdStore, WatchEvent
from gpupool_sdk.store.codec import encode
from gpupool_sdk.telemetry.pricing import PriceTable
from gpupool_sdk.telemetry.usage import UsageLedger, UsageRecord, accrue

log = logging.getLogger(__name__)

# etcd's default --max-txn-ops: the limit assumed when SchedulerConfig.etcd_max_txn_ops is 0.
DEFAULT_ETCD_MAX_TXN_OPS = 128
# Usage records of a job are written at most this often while it runs (and at release).
DEFAULT_USAGE_FLUSH_S = 15.0
# Usage is accrued at most this often (seconds).
USAGE_ACCRUE_S = 1.0
# Puts that need no new cycle (deletes still do: a lease expiring frees slices). Keys only the
# leader puts: our own writes (or a deposed leader's, which a new term re-reads anyway). And
# telemetry, which every job rewrites every few seconds: the next cycle reads it, at the latest
# loop_wait later, instead of a cycle per report.
#: ``Coordinator._usage_written`` of a job whose last usage write raised (it may have landed).
_UNKNOWN = -1
_QUIET_PUTS = frozenset({"jobs.status", "allocations", "directives", "checkpoints", "usage", "term", "telemetry"})

# Keys that never need a cycle, put or deleted: the leader's own autoscale signal, and the
# time-slicing turn and membership keys jobs pass between them every quantum.
_IGNORED_KINDS = frozenset({"autoscale", "prices", "timeslice.turn", "timeslice.member"})


def _granted_slices(decisions: Sequence[Any], granted_jobs: Sequence[str]) -> dict[str, tuple[SliceGrant, ...]]:
    """The slices of the cycle's grants that were written (``granted_jobs``), by job."""
    written = set(granted_jobs)
    return {d.job: d.slices for d in decisions if isinstance(d, st.Grant) and d.job in written}


@dataclass
class CycleReport:
    """What one scheduling cycle did (for logs, metrics and tests).

    Attributes:
        term: the term it ran under.
        revision: the etcd revision of its snapshot.
        decisions: how many decisions the scheduler returned.
        applied: applied decisions by kind.
        duration_s: wall time of the cycle (monotonic).
        problems: malformed keys skipped.
        decided: the scheduler's decisions (what metrics count by kind, reason and QoS).
        granted_jobs: jobs whose grant was written this cycle.
        snapshot: the snapshot the cycle scheduled on.
        autoscale: the autoscale signal computed after the cycle (None when autoscaling is off).
        skipped: the scheduler was not run: nothing but the clock changed since the last
            scheduled cycle, before its ``valid_until`` (``decisions`` 0, nothing applied).
        gpu_changed: writes refused because a GPU they add to changed after the snapshot, by
            plan kind (see :mod:`~gpupool_sdk.coordinator.apply`); the next cycle runs at once.
    """

    term: int
    revision: int
    decisions: int
    applied: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    problems: int = 0
    decided: tuple[st.Decision, ...] = ()
    granted_jobs: tuple[str, ...] = ()
    snapshot: st.ClusterSnapshot | None = None
    autoscale: AutoscaleSignal | None = None
    skipped: bool = False
    gpu_changed: dict[str, int] = field(default_factory=dict)


@dataclass
class CoordinatorStats:
    """Counters since start (exposed to metrics and ``run()`` callers)."""

    cycles: int = 0
    #: cycles whose scheduler run was skipped (nothing but the clock changed, see :class:`CycleReport`).
    skipped: int = 0
    decisions: int = 0
    applied: dict[str, int] = field(default_factory=dict)
    fenced_out: int = 0
    too_large: int = 0  # plans over etcd's --max-txn-ops (their grants became rejections)
    terms_won: int = 0
    orphans_deleted: int = 0  # orphaned keys garbage-collected after the grace
    #: writes refused because a GPU they add to changed since the snapshot (garbage written there)
    gpu_changed: int = 0
    last_cycle_s: float = 0.0
    last_error: str = ""


class Coordinator:
    """A coordinator replica: leader election, snapshot, schedule, fenced apply.

    Args:
        store: the etcd store (its keyspace is the pool's).
        config: the scheduler's policy knobs; its ``etcd_max_txn_ops`` must match etcd's
            ``--max-txn-ops`` (0: :data:`DEFAULT_ETCD_MAX_TXN_OPS`, etcd's default).
        timing: TTL, keepalive interval and retry deadline of the coordinator's lease.
        coordinator_id: this replica's id (default ``<hostname>-<pid>``).
        loop_wait_s: time between time-driven cycles and renewals (default
            ``timing.keepalive_interval_s``); ``loop_wait_s + 2 * retry_timeout_s <= ttl_s``.
        scheduler: the policy (default :class:`~gpupool_sdk.scheduler.policy.Scheduler` on ``config``).
        prices: price table for usage accounting (default catalog prices).
        usage_flush_s: how often running jobs' ``usage/{job}`` records are written.
        on_cycle: called after every cycle with its report (metrics, tests).
        orphan_grace_s: how long an orphaned key (see :mod:`~gpupool_sdk.coordinator.snapshot`)
            must be seen unchanged before the leader deletes it (default ``2 * timing.ttl_s``:
            a key on an expiring lease normally vanishes on its own first).
        autoscale: thresholds of the autoscale signal the leader publishes at ``{prefix}/autoscale``
            after each cycle (see :mod:`~gpupool_sdk.scheduler.autoscale`); None: not published.
        skip_unchanged: skip the scheduler (and the apply) in cycles where nothing but the clock
            changed, before the last scheduled cycle's ``valid_until`` (default True; False runs
            every cycle in full: the same writes, more CPU). Needs a scheduler whose ``run``
            returns a :class:`~gpupool_sdk.scheduler.types.ScheduleResult`.

    Raises:
        ConfigError: the timing relation does not hold, or ``orphan_grace_s`` is negative; the
            message names the setting.

    Example:
        >>> store = EtcdStore("127.0.0.1:2379")                                   # doctest: +SKIP
        >>> coord = Coordinator(store, SchedulerConfig(), LeaseTiming(10, 2, 3))  # doctest: +SKIP
        >>> coord.run()    # blocks until coord.stop() (e.g. from a SIGTERM handler)  # doctest: +SKIP
    """

    def __init__(
        self,
        store: EtcdStore,
        config: SchedulerConfig,
        timing: LeaseTiming,
        coordinator_id: str | None = None,
        loop_wait_s: float | None = None,
        scheduler: Any = None,
        prices: PriceTable | None = None,
        usage_flush_s: float = DEFAULT_USAGE_FLUSH_S,
        on_cycle: Callable[[CycleReport], None] | None = None,
        orphan_grace_s: float | None = None,
        autoscale: AutoscaleSettings | None = AutoscaleSettings(),  # noqa: B008 - frozen, never mutated
        skip_unchanged: bool = True,
    ) -> None:
        grace = 2 * timing.ttl_s if orphan_grace_s is None else orphan_grace_s
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace < float("inf"):
            raise ConfigError("orphan_grace_s", f"must be a finite number of seconds >= 0, got {orphan_grace_s!r}")
        self.orphan_grace_s = float(grace)
        # Orphaned keys by (key, mod revision) -> monotonic time this replica first saw them.
        self._orphans_seen: dict[tuple[str, int], float] = {}
        self.store = store
        self.keys = store.keys
        if config.etcd_max_txn_ops == 0:
            config = replace(config, etcd_max_txn_ops=DEFAULT_ETCD_MAX_TXN_OPS)  # etcd always has a limit
        self.config = config
        self.timing = ElectionTiming(timing, timing.keepalive_interval_s if loop_wait_s is None else loop_wait_s)
        if scheduler is None:
            from gpupool_sdk.scheduler.policy import Scheduler

            scheduler = Scheduler(config)
        self.scheduler = scheduler
        self.election = Election(store, coordinator_id, self.timing, on_demoted=self._on_demoted)
        self.id = self.election.id
        self.writer = FencedWriter(store, self.election.fence, self.election.demote)
        self.applier = Applier(self.writer, self.keys, config, store.revoke_lease, usage=self._usage_body)
        self.prices = prices if prices is not None else PriceTable()
        self.usage_flush_s = usage_flush_s
        self.on_cycle = on_cycle
        self.stats = CoordinatorStats()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._leader_event = threading.Event()
        self._watcher: Any = None
        self._ledger: UsageLedger | None = None
        self._ledger_dirty: set[str] = set()
        # usage/{job} mod revision of this term's last committed write (_UNKNOWN: a write whose
        # outcome is not known); with the last snapshot's revisions they guard every usage write.
        self._usage_written: dict[str, int] = {}
        self._reset_ledger = False
        # Jobs being charged: their slices and the monotonic time they are charged up to.
        self._holding: dict[str, tuple[tuple[Allocation, ...], float]] = {}
        self._closed: set[str] = set()  # released this cycle (still in the cycle's snapshot)
        self._last_accrual: float | None = None
        self._last_flush = 0.0
        self._last_state: PoolState | None = None
        self._cycle_lock = threading.Lock()
        self._cache = DecodeCache()
        self.autoscaler = Autoscaler(autoscale) if autoscale is not None else None
        self._published_signal: AutoscaleSignal | None = None
        self._prices_term = 0  # the term in which this replica last published its price table
        self.skip_unchanged = skip_unchanged
        # The last scheduled cycle, when all its decisions were applied: (inputs, valid_until).
        self._scheduled: tuple[tuple[int, int, int], float] | None = None
        # Per key: whether the scheduler's snapshot is built from it (keys never change shape).
        self._input_keys: dict[str, bool] = {}
        # Never read nor watched: the agents' usage readings, rewritten every few seconds per GPU.
        self._unread = (self.keys.readings_prefix(),)

    # ------------------------------------------------------------------ state

    @property
    def is_leader(self) -> bool:
        """True while this replica leads (and can still trust that it does)."""
        return self.election.is_leader()

    @property
    def term(self) -> int:
        return self.election.term

    @property
    def last_state(self) -> PoolState | None:
        """The state the last cycle scheduled on."""
        return self._last_state

    def _on_demoted(self, reason: str) -> None:
        # May run on the lease keeper's thread: only flag here; the loop's thread resets the ledger.
        self.stats.fenced_out += 1
        self._reset_ledger = True
        self._wake.set()

    # ------------------------------------------------------------------ watch

    def _on_events(self, events: list[WatchEvent]) -> None:
        leader_key = self.keys.leader()
        wake = False
        for e in events:
            if e.kv.key == leader_key:
                self._leader_event.set()
                wake = True
                continue
            parsed = self.keys.parse(e.kv.key)
            if parsed is not None and parsed.kind in _IGNORED_KINDS:
                continue
            if e.type == "put":
                if e.prev is not None and e.prev.value == e.kv.value and e.prev.lease == e.kv.lease:
                    continue  # rewritten unchanged
                if parsed is not None and parsed.kind in _QUIET_PUTS:
                    continue
            wake = True
        if wake:
            self._wake.set()

    def _on_resync(self) -> int | None:
        self._wake.set()
        self._leader_event.set()
        return None

    # ------------------------------------------------------------------ loop

    def stop(self) -> None:
        """Ask the loop to end; :meth:`run` resigns leadership before it returns. Signal-safe."""
        self._stop.set()
        self._wake.set()
        self._leader_event.set()

    def run(self) -> CoordinatorStats:
        """Run until :meth:`stop`; resigns leadership (if held) before returning."""
        self._watcher = self.store.watch_prefix(
            self.keys.root(), self._on_events, on_resync=self._on_resync, skip=self._unread
        )
        next_renew = 0.0
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._leader_event.clear()
                timeout = self.timing.loop_wait_s
                try:
                    now_m = time.monotonic()
                    if self.election.term == 0 or now_m >= next_renew:
                        leading = self.election.step()
                        next_renew = now_m + self.timing.loop_wait_s
                        if leading and self.election.terms_won > self.stats.terms_won:
                            self.stats.terms_won = self.election.terms_won
                    else:
                        leading = self.election.is_leader()
                    if leading:
                        report = self.run_cycle()
                        if report is not None:
                            timeout = min(timeout, self._until_next_deadline())
                    timeout = min(timeout, max(0.0, next_renew - time.monotonic()))
                    self.stats.last_error = ""
                except StoreError as exc:
                    self.stats.last_error = str(exc)
                    log.warning("coordinator %s: etcd error: %s", self.id, exc)
                except NotLeaderError:
                    pass
                except Exception as exc:  # noqa: BLE001 - one bad cycle must not kill the replica
                    # Like Patroni's loop: log and carry on; every write is fenced, so a confused
                    # cycle cannot grant what it should not, and the next cycle re-reads everything.
                    self.stats.last_error = f"{type(exc).__name__}: {exc}"
                    log.exception("coordinator %s: cycle failed", self.id)
                if self._stop.is_set():
                    break
                if self.election.term:
                    # Events that land while a cycle runs are seen by the next one's fresh read.
                    self._wake.wait(timeout)
                else:
                    self._leader_event.wait(timeout)  # standby: only the leader key's changes matter
        finally:
            self._shutdown()
        return self.stats

    def _shutdown(self) -> None:
        if self._watcher is not None:
            try:
                self._watcher.cancel()
            except GpupoolError as exc:
                log.info("watch cancel: %s", exc)
        if self.election.term:
            try:
                self._flush_usage(force=True)
            except (StoreError, NotLeaderError) as exc:
                log.info("final usage flush skipped: %s", exc)
        self.election.resign()

    def _until_next_deadline(self) -> float:
        state = self._last_state
        if state is None:
            return self.timing.loop_wait_s
        now = time.time()
        # Only deadlines still ahead: one already past was seen by the cycle that just ran (a
        # deflate directive, say, may legitimately outlive its deadline; no busy loop for it).
        ahead = [
            v.directive.deadline
            for v in state.snapshot.jobs.values()
            if v.directive is not None and v.directive.deadline > state.snapshot.now
        ]
        if not ahead:
            return self.timing.loop_wait_s
        # A little past the deadline so the cycle sees it expired.
        return max(0.0, min(ahead) - now + 0.01)

    # ------------------------------------------------------------------ one cycle

    def read_state(self, term: int = 0) -> PoolState:
        """Read the whole pool prefix (but the agents' usage readings) at one revision and parse it."""
        return self._read(term)[0]

    def _read(self, term: int) -> tuple[PoolState, tuple[int, int, int]]:
        """The state, and what identifies the scheduler's input but for the clock: (term, number
        of input keys, their largest mod revision). Revisions only grow, so any put of an input
        key raises the largest and any delete alone lowers the count: equal means unchanged.
        The agents' usage readings are not read at all (etcd sends none of them)."""
        kvs, revision = self.store.get_prefix(self.keys.root(), skip=self._unread)
        state = build_state(kvs, self.keys, time.time(), revision, term, cache=self._cache)
        known = self._input_keys
        if len(known) > 2 * len(kvs) + 1024:
            known.clear()  # forget keys long gone
        count = top = 0
        for kv in kvs:
            used = known.get(kv.key)
            if used is None:
                parsed = self.keys.parse(kv.key)
                # Usage records and the ignored kinds are not read by the scheduler's snapshot.
                used = parsed is None or (parsed.kind not in _IGNORED_KINDS and parsed.kind != "usage")
                known[kv.key] = used
            if used:
                count += 1
                top = max(top, kv.mod_revision)
        return state, (term, count, top)

    def run_cycle(self) -> CycleReport | None:
        """One scheduling cycle if this replica leads; None otherwise."""
        with self._cycle_lock:
            if self._reset_ledger:
                # A later term re-seeds from etcd: another leader may have written usage since.
                self._reset_ledger = False
                self._ledger = None
                self._ledger_dirty.clear()
                self._usage_written.clear()
                self._holding.clear()
                self._closed.clear()
                self._last_accrual = None
                if self.autoscaler is not None:
                    self.autoscaler.forget()
                    self._published_signal = None
            fence = self.election.fence()
            if fence is None:
                return None
            t0 = time.monotonic()
            state, inputs = self._read(fence.term)
            last = self._scheduled
            skip = (
                self.skip_unchanged
                and last is not None
                and last[0] == inputs
                and state.snapshot.now < last[1]
            )
            decisions: Sequence[st.Decision] = ()
            report = ApplyReport()
            if not skip:
                self._scheduled = None
                run = getattr(self.scheduler, "run", None) if self.skip_unchanged else None
                result = run(state.snapshot) if run is not None else self.scheduler.schedule(state.snapshot)
                decisions = getattr(result, "decisions", result)
                report = self.applier.apply(decisions, state)
                valid_until = getattr(result, "valid_until", None)
                if valid_until is not None and not report.lost and not report.too_large:
                    # Every decision was applied: a cycle before valid_until on the same input repeats them.
                    self._scheduled = (inputs, valid_until)
            self._last_state = state
            # After the writes, so accounting and garbage collection never delay a grant.
            self._account(state, report.granted)
            self._collect_orphans(state)
            self.stats.too_large += report.too_large
            if report.gpu_changed:
                self.stats.gpu_changed += sum(report.gpu_changed.values())
                # Decide again at once from a fresh read (an allocation put wakes no cycle).
                self._wake.set()
            for kind, n in report.applied.items():
                self.stats.applied[kind] = self.stats.applied.get(kind, 0) + n
            if any(k in report.applied for k in ("Release", "Regrant", "Revoke")) or time.monotonic() - self._last_flush >= self.usage_flush_s:
                self._flush_usage()
                if self._ledger is not None:
                    self._forget_idle(state)
            signal = self._publish_autoscale(state, _granted_slices(decisions, report.granted_jobs))
            self._publish_prices(fence.term)
            cycle = CycleReport(
                term=fence.term,
                revision=state.revision,
                decisions=len(decisions),
                applied=dict(report.applied),
                duration_s=time.monotonic() - t0,
                problems=len(state.problems),
                decided=tuple(decisions),
                granted_jobs=tuple(report.granted_jobs),
                snapshot=state.snapshot,
                autoscale=signal,
                skipped=skip,
                gpu_changed=dict(report.gpu_changed),
            )
            self.stats.cycles += 1
            self.stats.skipped += skip
            self.stats.decisions += len(decisions)
            self.stats.last_cycle_s = cycle.duration_s
            if self.on_cycle is not None:
                self.on_cycle(cycle)
            return cycle

    # ------------------------------------------------------------------ autoscale

    def _publish_autoscale(self, state: PoolState, granted: Mapping[str, Sequence[SliceGrant]]) -> AutoscaleSignal | None:
        """Compute the autoscale signal; write ``{prefix}/autoscale`` (fenced, no lease) when its advice changed.

        The cycle's snapshot was read before its grants: ``granted`` (the grants that were written)
        turns it into the state after the cycle, so those jobs are not demand and their GPUs not free.
        """
        if self.autoscaler is None:
            return None
        signal = self.autoscaler.update(state.snapshot, granted)
        if not signal.same_advice(self._published_signal):
            try:
                if self.writer.write([PutOp(self.keys.autoscale(), encode(signal))]):
                    self._published_signal = signal
            except GpupoolError as e:  # the signal is advice: never let it fail a cycle
                log.warning("could not publish the autoscale signal: %s", e)
        return signal

    def _publish_prices(self, term: int) -> None:
        """Write the price table the leader accrues with at ``{prefix}/prices`` once per term (fenced, no lease).

        The CLI's cost and advice columns read it, so that ``gpupool top`` prices with the policy
        file's ``[prices]`` without being given the file.
        """
        if self._prices_term == term:
            return
        try:
            if self.writer.write([PutOp(self.keys.prices(), encode(self.prices))]):
                self._prices_term = term
        except GpupoolError as e:  # reporting only: never let it fail a cycle
            log.warning("could not publish the price table: %s", e)

    # ------------------------------------------------------------------ orphans

    def _collect_orphans(self, state: PoolState) -> None:
        """Delete orphaned keys seen unchanged for ``orphan_grace_s`` (fenced; a lost guard is routine)."""
        now_m = time.monotonic()
        current = {(o.key, o.mod_revision): o for o in state.orphans}
        for k in [k for k in self._orphans_seen if k not in current]:
            del self._orphans_seen[k]
        for k, o in sorted(current.items()):
            first = self._orphans_seen.setdefault(k, now_m)
            if now_m - first < self.orphan_grace_s:
                continue
            if self.writer.write([DeleteOp(o.key)], [Unchanged(o.key, o.mod_revision)]):
                self.stats.orphans_deleted += 1
                log.warning("deleted orphan %s (%s) after %.0fs", o.key, o.reason, now_m - first)
            elif not self.writer.check():
                return  # no longer the leader
            self._orphans_seen.pop(k, None)

    # ------------------------------------------------------------------ usage

    def _record(self, job: str, state: PoolState) -> UsageRecord | None:
        """The ledger's record of ``job``, loaded from its ``usage/{job}`` key when not in memory."""
        assert self._ledger is not None
        rec = self._ledger.get(job)
        if rec is None and job in state.usage:
            try:
                rec = UsageRecord.from_dict(state.usage[job], where=f"usage/{job}")
            except (SpecError, TypeError, ValueError) as exc:
                log.warning("usage/%s unreadable, restarting its count: %s", job, exc)
                return None
            self._ledger.records[job] = rec
        return rec

    def _forget_idle(self, state: PoolState) -> None:
        """Drop records of jobs that are gone and flushed (``usage/{job}`` keeps them)."""
        assert self._ledger is not None
        for job in [j for j in self._ledger.records if j not in self._holding and j not in self._ledger_dirty]:
            if job not in state.snapshot.jobs:
                del self._ledger.records[job]
                self._usage_written.pop(job, None)

    def _charge(self, job: str, allocs: Sequence[Allocation], until_m: float, state: PoolState) -> None:
        """Charge ``job`` for holding ``allocs`` from where it was charged up to, to ``until_m``."""
        assert self._ledger is not None
        held = self._holding.get(job)
        since = held[1] if held is not None else until_m
        dt = max(0.0, until_m - since)
        now_wall = time.time() - max(0.0, time.monotonic() - until_m)
        view = state.snapshot.jobs.get(job)
        rec = self._record(job, state) or UsageRecord.new(
            job, owner=view.spec.owner if view else "", qos=allocs[0].mode if allocs else "guaranteed", now=now_wall - dt
        )
        if view is not None and view.spec.owner and view.spec.owner != rec.owner:
            rec = replace(rec, owner=view.spec.owner)
        self._ledger.records[job] = accrue(rec, allocs, state.snapshot.gpus, dt, self.prices, now=now_wall)
        self._ledger_dirty.add(job)

    def _account(self, state: PoolState, new_grants: Mapping[str, Sequence[Allocation]] | None = None) -> None:
        """Track who holds slices; charge jobs whose slices changed or vanished, and everyone once a second.

        A job is charged from its grant (``Allocation.granted_at``) or from where its record was
        last charged, whichever is later, up to when this leader saw its slices change or vanish,
        so short jobs and jobs that simply finished are charged too. ``new_grants``: the slices this
        cycle's grants wrote (after ``state`` was read), tracked from now on, so a job that ends
        before the next snapshot is charged for them too.
        """
        now_m = time.monotonic()
        if self._ledger is None:
            self._ledger = UsageLedger()  # records load from usage/{job} as jobs are charged
            self._holding.clear()
            self._last_accrual = now_m
        current: dict[str, list[Allocation]] = {}
        for a in state.allocations:
            current.setdefault(a.job, []).append(a)
        for job, (allocs, _since) in list(self._holding.items()):
            cur = current.get(job)
            if cur is None or {(a.gpu_uuid, a.memory_bytes, a.compute_share) for a in cur} != {
                (a.gpu_uuid, a.memory_bytes, a.compute_share) for a in allocs
            }:
                self._charge(job, allocs, now_m, state)
                if cur is None:
                    del self._holding[job]
                else:
                    self._holding[job] = (tuple(cur), now_m)
        for job, cur in current.items():
            if job not in self._holding and job not in self._closed:
                granted = min((a.granted_at for a in cur if a.granted_at), default=state.snapshot.now)
                rec = self._record(job, state)
                start_wall = max(granted, rec.last_seen if rec is not None else 0.0)
                self._holding[job] = (tuple(cur), now_m - max(0.0, state.snapshot.now - start_wall))
        for job, written in (new_grants or {}).items():
            if not written:
                continue
            if job in self._holding:
                self._charge(job, self._holding[job][0], now_m, state)  # what it held up to this grant
            elif self._record(job, state) is None:
                view = state.snapshot.jobs.get(job)  # the owner, while the spec is still in sight
                self._ledger.records[job] = UsageRecord.new(
                    job, owner=view.spec.owner if view else "", qos=written[0].mode, now=time.time()
                )
            self._holding[job] = (tuple(written), now_m)
        if self._last_accrual is None or now_m - self._last_accrual >= USAGE_ACCRUE_S:
            self._last_accrual = now_m
            for job, (allocs, _since) in list(self._holding.items()):
                self._charge(job, allocs, now_m, state)
                self._holding[job] = (allocs, now_m)
        self._closed.clear()

    def _usage_body(self, job: str, state: PoolState, now: float) -> Mapping[str, Any] | None:
        # Written with Release/Revoke: charge this job up to now and stop tracking it.
        if self._ledger is None:
            self._account(state)
        view = state.snapshot.jobs[job]
        held = self._holding.get(job)
        allocs = held[0] if held is not None else view.allocations
        if held is None and view.allocations:
            since_wall = min((a.granted_at for a in view.allocations if a.granted_at), default=now)
            rec = self._record(job, state)
            since_wall = max(since_wall, rec.last_seen if rec is not None else 0.0)
            self._holding[job] = (view.allocations, time.monotonic() - max(0.0, now - since_wall))
        self._charge(job, allocs, time.monotonic(), state)
        self._holding.pop(job, None)
        self._closed.add(job)  # its slices are gone after this cycle's writes: do not track it again
        assert self._ledger is not None
        rec = self._ledger.get(job)
        self._ledger_dirty.discard(job)
        return rec.to_dict() if rec is not None else None

    def _usage_guard(self, job: str) -> Guard | None:
        """What a write of ``usage/{job}`` must find: the key as this leader last wrote or read it.

        None: do not write (a job that has left, whose last write may have landed and been
        deleted since by ``gpupool job forget``: re-creating it would undo the operator).
        """
        key = self.keys.usage(job)
        state = self._last_state
        own = self._usage_written.get(job)
        seen = state.usage_revisions.get(job) if state is not None else None
        if own is not None and own != _UNKNOWN:
            return Unchanged(key, max(own, seen or 0))
        if seen is not None:
            return Unchanged(key, seen)
        if own == _UNKNOWN and (state is None or job not in state.snapshot.jobs):
            return None
        return Absent(key)

    def _flush_usage(self, force: bool = False) -> None:
        """Write the changed ``usage/{job}`` records, each guarded by :meth:`_usage_guard`.

        A record whose key changed under this leader (forgotten by an operator, written by an
        earlier term) is dropped from memory, not written: it reloads from etcd if the job is
        charged again. A write that raised (its outcome unknown) is retried against the next snapshot.
        """
        if self._ledger is None or not self._ledger_dirty:
            self._last_flush = time.monotonic()
            return
        jobs = sorted(self._ledger_dirty)
        step = max(1, min(32, self.config.etcd_max_txn_ops // 2))  # etcd caps operations (and compares) per txn
        for i in range(0, len(jobs), step):
            chunk = [j for j in jobs[i : i + step] if self._ledger.get(j) is not None]
            planned: list[tuple[str, PutOp, Guard]] = []
            for job in chunk:
                rec, guard = self._ledger.get(job), self._usage_guard(job)
                if rec is None:
                    continue
                if guard is None:
                    self._drop_usage(job, "it left and its record may have been forgotten since")
                    continue
                planned.append((job, PutOp(self.keys.usage(job), encode(rec)), guard))
            # One transaction for the chunk; when a guard fails, each job alone finds which.
            if planned and not self._commit_usage(planned):
                for one in planned if len(planned) > 1 else ():
                    if not self._commit_usage([one]):
                        self._drop_usage(one[0], "its usage key changed under this leader (forgotten?)")
                if len(planned) == 1:
                    self._drop_usage(planned[0][0], "its usage key changed under this leader (forgotten?)")
        self._last_flush = time.monotonic()

    def _commit_usage(self, batch: list[tuple[str, PutOp, Guard]]) -> bool:
        """Write ``batch`` in one fenced, guarded transaction; False when a guard (or the fence) failed."""
        try:
            revision = self.writer.commit([op for _, op, _ in batch], [g for _, _, g in batch])
        except StoreError:
            for job, _, _ in batch:
                self._usage_written[job] = _UNKNOWN
            raise
        if revision is None:
            return False
        for job, _, _ in batch:
            self._usage_written[job] = revision
            self._ledger_dirty.discard(job)
        return True

    def _drop_usage(self, job: str, why: str) -> None:
        assert self._ledger is not None
        log.info("usage/%s not written: %s", job, why)
        self._ledger.records.pop(job, None)
        self._ledger_dirty.discard(job)
        self._usage_written.pop(job, None)
