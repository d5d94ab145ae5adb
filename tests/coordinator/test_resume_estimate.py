"""A preempted job's last remaining-time estimate survives its re-submission (checkpoints/{job}).

Without it a job queued again is ranked by attained service while it waits (its telemetry went
with its lease) and by remaining service once it runs, and two such jobs preempt each other back
and forth (found by ``benchmarks/live_miniature.py``).
"""

from __future__ import annotations

from coordinator.kvkit import KS, NOW, Items, pool_items
from gpupool_sdk.coordinator.apply import resume_record
from gpupool_sdk.coordinator.snapshot import build_state
from gpupool_sdk.resources import Allocation, GiB, JobSpec, JobState, JobStatus, QoS
from gpupool_sdk.store.codec import decode, encode
from gpupool_sdk.store.records import ResumeRecord

UUID = "GPU-sim-node-a-0"


def _pool() -> Items:
    return pool_items(leader=True)


def test_a_waiting_job_is_ranked_by_its_kept_estimate_until_it_publishes_again() -> None:
    it = _pool()
    it.put(KS.job_spec("a"), JobSpec(name="a", gpus=1, memory="1GiB"), lease=0xA)
    it.put(KS.checkpoint("a"), ResumeRecord("a", None, 1, 500.0, 100.0, remaining_s=250.0))
    assert build_state(it.kvs, KS, NOW).snapshot.jobs["a"].remaining_s == 250.0
    # Its own telemetry wins once it publishes (and an undeclared job's telemetry says none).
    it.put(KS.telemetry("a"), {"job": "a", "at": 1.0, "summary": {"remaining_s": 40.0}}, lease=0xA)
    assert build_state(it.kvs, KS, NOW).snapshot.jobs["a"].remaining_s == 40.0
    it.put(KS.telemetry("a"), {"job": "a", "at": 2.0, "summary": {"step": 3}}, lease=0xA)
    assert build_state(it.kvs, KS, NOW).snapshot.jobs["a"].remaining_s is None


def test_the_release_of_a_preempted_job_keeps_its_estimate_and_a_finished_job_keeps_none() -> None:
    it = _pool()
    it.put(KS.job_spec("a"), JobSpec(name="a", gpus=1, memory="1GiB"), lease=0xA)
    it.put(KS.job_status("a"), JobStatus(JobState.PREEMPTING, "r", 900.0, 800.0, 850.0, term=3, gpus=1), lease=0xA)
    it.put(KS.allocation("node-a", UUID, "a"), Allocation("a", "node-a", UUID, 0, GiB, 1.0, QoS.GUARANTEED, 3, 850.0),
           lease=0xA)
    it.put(KS.telemetry("a"), {"job": "a", "at": 1.0, "summary": {"remaining_s": 75.0}}, lease=0xA)
    state = build_state(it.kvs, KS, NOW, term=3)
    kept = resume_record(state, "a", preempted=True)
    assert kept.remaining_s == 75.0
    assert resume_record(state, "a", preempted=False).remaining_s is None
    # What the leader writes reads back the same; a negative value read from etcd is no estimate.
    assert decode(KS.checkpoint("a"), encode(kept), ResumeRecord) == kept
    assert ResumeRecord.from_dict({"job": "a", "remaining_s": -1}).remaining_s is None
    assert ResumeRecord.from_dict({"job": "a"}).remaining_s is None

def test_a_job_queued_again_after_a_preemption_keeps_its_place_in_submission_order() -> None:
    it = _pool()
    it.put(KS.job_spec("early"), JobSpec(name="early", gpus=1, memory="1GiB"), lease=0xA)
    it.put(KS.job_status("early"), JobStatus(JobState.PREEMPTING, "r", 900.0, 800.0, 850.0, term=3, gpus=1), lease=0xA)
    it.put(KS.allocation("node-a", UUID, "early"),
           Allocation("early", "node-a", UUID, 0, GiB, 1.0, QoS.GUARANTEED, 3, 850.0), lease=0xA)
    it.put(KS.job_spec("later"), JobSpec(name="later", gpus=1, memory="1GiB"), lease=0xB)
    state = build_state(it.kvs, KS, NOW, term=3)
    first = state.snapshot.jobs["early"].order
    assert first < state.snapshot.jobs["later"].order
    kept = resume_record(state, "early", preempted=True)
    assert kept.order == first and resume_record(state, "early", preempted=False).order == 0
    # Released, then submitted again under its name: a new spec (a later revision), its old place.
    it.kvs = [kv for kv in it.kvs if "/early" not in kv.key or kv.key == KS.checkpoint("early")]
    it.put(KS.checkpoint("early"), kept)
    it.put(KS.job_spec("early"), JobSpec(name="early", gpus=1, memory="1GiB"), lease=0xD)
    again = build_state(it.kvs, KS, NOW + 10, term=3).snapshot.jobs
    assert again["early"].order == first < again["later"].order
    # A job that ended keeps no place: submitted again, it queues as new.
    it.put(KS.checkpoint("early"), resume_record(state, "early", preempted=False))
    assert build_state(it.kvs, KS, NOW + 20, term=3).snapshot.jobs["early"].order > again["later"].order
