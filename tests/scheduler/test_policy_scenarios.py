"""Scenario tests of one or several whole ``schedule()`` cycles over small snapshots."""

from __future__ import annotations

from sched_helpers import by_job, gpus, job, only, run, running, snap

from gpupool_sdk.resources import GiB
from gpupool_sdk.scheduler import Grant, Queue, Reject


def test_grant_single_fractional_job() -> None:
    g = gpus("node-a:2xH100-80GB:nvlink")
    d = only(run(snap(g, [job("a", memory="20GiB")])), "a")
    assert isinstance(d, Grant)
    assert len(d.slices) == 1 and d.slices[0].memory_bytes == 20 * GiB


def test_queue_when_full_and_reject_impossible() -> None:
    g = gpus("node-a:1xH100-80GB:nvlink")
    big = running(job("big", memory="70GiB"), [next(iter(g.values()))])
    ds = run(snap(g, [big, job("b", memory="20GiB"), job("c", memory="200GiB")]))
    assert isinstance(only(ds, "b"), Queue)
    rej = only(ds, "c")
    assert isinstance(rej, Reject) and "largest matching GPU has 80.0GiB" in rej.reason


def test_empty_pool_queues() -> None:
    d = only(run(snap({}, [job("a", memory="1GiB")])), "a")
    assert isinstance(d, Queue) and "no GPUs published" in d.reason


def test_best_fit_prefers_partly_used_gpu() -> None:
    g = gpus("node-a:2xH100-80GB:nvlink")
    first = list(g.values())[1]
    held = running(job("x", memory="40GiB", compute_share=0.5), [first])
    d = only(run(snap(g, [held, job("a", memory="20GiB", compute_share=0.5)])), "a")
    assert isinstance(d, Grant) and d.slices[0].gpu_uuid == first.uuid


def test_each_pending_job_gets_one_decision() -> None:
    g = gpus("node-a:4xH100-80GB:nvlink")
    jobs = [job(f"j{i}", memory="30GiB", qos="shared", order=i) for i in range(12)]
    ds = run(snap(g, jobs))
    assert sorted(by_job(ds)) == sorted(j.name for j in jobs)
    assert all(len(v) == 1 for v in by_job(ds).values())
    assert sum(isinstance(d, Grant) for d in ds) == 8
