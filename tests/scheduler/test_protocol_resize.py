"""The protocol stage and a resize: a refused resize keeps the grant and backs off; a preempt that
superseded a resize is acked by that resize's ack too.

Every pool here is whole H100-80GB GPUs and every job asks 70 GiB per slice, so a GPU takes one
slice at most.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from sched_helpers import gpus, job, running, snap

from gpupool_sdk.resources import Ack, Directive, DirectiveKind, JobState
from gpupool_sdk.scheduler import (
    JobView,
    Preempt,
    Release,
    Resize,
    Revoke,
    Scheduler,
    SchedulerConfig,
    Withdraw,
)
from gpupool_sdk.scheduler.protocol import resize_held_off, resize_retry_at

POOL = gpus("a:2xH100-80GB:nvlink")
G = list(POOL.values())
MEM = "70GiB"
# No order that moves with time: the horizon is a real instant, not ``now``.
STILL = SchedulerConfig(aging_s_per_priority=0.0, max_wait_s=0.0, resize_retry_s=100.0)


def el_on(n: int, **fields: Any) -> JobView:
    return running(job("el", gpus=1, min_gpus=1, max_gpus=2, memory=MEM), G[:n], **fields)


def resize(seq: int = 3, gpus: int = 2, deadline: float = 1000.0, **target: object) -> Directive:
    return Directive(DirectiveKind.RESIZE, seq, deadline, {"gpus": gpus, **target})


@pytest.mark.parametrize(("refusals", "wait"), [(0, 100.0), (1, 200.0), (3, 800.0), (4, 1600.0), (9, 1600.0)])
def test_a_refused_resize_is_withdrawn_with_a_backoff_doubling_per_refusal(refusals: int, wait: float) -> None:
    el = el_on(1, directive=resize(), ack=Ack(seq=3, step=40, ok=False, message="the data loader cannot reshard"),
               state=JobState.PREEMPTING, resize_refusals=refusals)
    ds = Scheduler(STILL).schedule(snap(POOL, [el], now=50.0))
    assert [type(d) for d in ds] == [Withdraw]
    (w,) = ds
    assert isinstance(w, Withdraw) and w.job == "el" and w.retry_at == 50.0 + wait
    assert "refused at step 40: the data loader cannot reshard" in w.reason and "grant of 1 kept" in w.reason


def test_a_refused_resize_is_never_a_release_nor_a_re_placement() -> None:
    # Before the fix a refusal was released to PENDING and placed again, like an accepted resize.
    el = el_on(2, directive=resize(gpus=1), ack=Ack(seq=3, ok=False), state=JobState.PREEMPTING)
    ds = Scheduler(STILL).schedule(snap(POOL, [el], now=50.0))
    assert not [d for d in ds if isinstance(d, (Release, Revoke, Resize))]
    assert [d.job for d in ds if isinstance(d, Withdraw)] == ["el"]


def test_no_growth_is_proposed_while_the_backoff_holds_and_it_is_in_the_horizon() -> None:
    el = el_on(1, resize_retry_at=150.0, resize_refusals=1)
    result = Scheduler(STILL).run(snap(POOL, [el], now=50.0))
    assert not [d for d in result.decisions if isinstance(d, Resize)]
    assert result.valid_until == 150.0  # the coordinator may skip cycles until then, not after
    later = Scheduler(STILL).schedule(snap(POOL, [el], now=150.0))
    assert [(type(d), d.gpus) for d in later if isinstance(d, Resize)] == [(Resize, 2)]


def test_a_job_held_off_is_not_shrunk_for_a_pending_job_but_may_be_preempted_whole() -> None:
    el = el_on(2, resize_retry_at=500.0, resize_refusals=1)
    hi = job("hi", memory=MEM, priority=5, order=1)
    ds = Scheduler(STILL).schedule(snap(POOL, [el, hi], now=50.0))
    assert not [d for d in ds if isinstance(d, Resize)]
    assert [(d.job, d.for_job) for d in ds if isinstance(d, Preempt)] == [("el", "hi")]
    # Once the backoff is over the cheaper shrink is proposed again.
    ds = Scheduler(STILL).schedule(snap(POOL, [replace(el, resize_retry_at=40.0), hi], now=50.0))
    assert [(d.job, d.gpus, d.for_job) for d in ds if isinstance(d, Resize)] == [("el", 1, "hi")]


def test_resize_retry_helpers() -> None:
    el = el_on(1, resize_retry_at=150.0)
    assert resize_held_off(el, 149.9) and not resize_held_off(el, 150.0)
    assert not resize_held_off(el_on(1), 0.0)
    assert resize_retry_at(el_on(1, resize_refusals=2), 10.0, STILL) == 410.0


@pytest.mark.parametrize("acked_seq", [3, 4])
def test_a_preempt_that_superseded_a_resize_is_acked_by_either_seq(acked_seq: int) -> None:
    d = Directive(DirectiveKind.PREEMPT, 4, 1000.0, {"for_job": "hi", "supersedes": 3})
    el = el_on(2, directive=d, ack=Ack(seq=acked_seq, step=9, checkpoint="/c/9"), state=JobState.PREEMPTING)
    ds = Scheduler(STILL).schedule(snap(POOL, [el], now=50.0))
    rel = [x for x in ds if isinstance(x, Release)]
    assert [(r.job, r.state) for r in rel] == [("el", JobState.SUSPENDED)]


def test_a_refused_ack_of_the_superseded_resize_does_not_ack_the_preempt() -> None:
    # The job refused the resize and carries on: it sees the preempt at its next step boundary.
    d = Directive(DirectiveKind.PREEMPT, 4, 1000.0, {"supersedes": 3})
    el = el_on(2, directive=d, ack=Ack(seq=3, ok=False), state=JobState.PREEMPTING)
    ds = Scheduler(STILL).schedule(snap(POOL, [el], now=50.0))
    assert not [x for x in ds if isinstance(x, (Release, Withdraw))]
    # ... and past the preempt's deadline it is forced.
    ds = Scheduler(STILL).schedule(snap(POOL, [el], now=1001.0))
    assert [x.job for x in ds if isinstance(x, Revoke)] == ["el"]
