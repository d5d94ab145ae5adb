"""A pool whose cycles a test drives by hand: snapshot, schedule, apply (real etcd, no coordinator loop)."""

from __future__ import annotations

from dataclasses import dataclass

from gpupool_sdk.coordinator.apply import Applier, ApplyReport
from gpupool_sdk.coordinator.election import Election
from gpupool_sdk.coordinator.snapshot import PoolState, build_state
from gpupool_sdk.resources import GpuInfo
from gpupool_sdk.scheduler import Scheduler
from gpupool_sdk.scheduler import types as st
from gpupool_sdk.store import EtcdStore


@dataclass
class DrivenCycles:
    """Base of a test's pool dataclass: the store, the leader's election, applier and scheduler, and
    the GPUs published (subclasses add their own fields after these)."""

    store: EtcdStore
    election: Election
    applier: Applier
    scheduler: Scheduler
    gpus: list[GpuInfo]

    def state(self, now: float) -> PoolState:
        """The pool as the leader would read it at ``now``."""
        kvs, rev = self.store.get_prefix(self.store.keys.root())
        return build_state(kvs, self.store.keys, now, rev, self.election.term)

    def cycle(self, now: float) -> tuple[list[st.Decision], ApplyReport]:
        """One cycle at ``now``: the scheduler's decisions and what the applier wrote (nothing lost)."""
        state = self.state(now)
        # Nothing here writes allocations but the leader: each must read back as its job's own
        # (an orphan would be a writer whose allocations disagree with the status, e.g. its granted_at).
        assert not [o for o in state.orphans if o.allocation is not None], state.orphans
        decisions = self.scheduler.schedule(state.snapshot)
        report = self.applier.apply(decisions, state)
        assert report.lost == 0
        return decisions, report
