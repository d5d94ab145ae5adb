"""Hand-edited garbage under every key family (written with etcdctl) is reported and skipped, never fatal.

One live pool for the module: a real ``gpupool agent --simulate`` and a real ``gpupool coordinator``.
The garbage stays in place for the later tests, so they also show that scheduling goes on around it.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable

import pytest
from scenarios.harness import Pool, wait_for

from acceptance.cli import explain, gpupool_many
from acceptance.conftest import AGENT_SPEC
from gpupool_sdk.cli.common import EXIT_OK
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import GpuInfo, JobState, LeaderRecord
from gpupool_sdk.store.codec import decode

Etcdctl = Callable[..., subprocess.CompletedProcess[str]]
AGENT_UUIDS = [g.uuid for g in parse_cluster_spec(AGENT_SPEC)]

# Values no reader can use: each would crash a reader that trusted Python's json module.
GARBAGE = {
    "notjson": "{oops",
    "list": "[1, 2]",
    "schema": '{"schema": 99, "kind": "Future"}',
    "nan": '{"schema": 1, "kind": "X", "v": NaN}',  # Python's json accepts NaN; JSON does not
    "huge": '{"schema": 1, "kind": "X", "v": 1e999}',  # parses to inf: int(inf) raises OverflowError
    "deep": '{"schema": 1, "v": ' + "[" * 3000 + "]" * 3000 + "}",  # RecursionError in json.loads
}
# Valid JSON and schema, but a field that cannot be used: the problem must name the field.
BAD_FIELDS = {
    "spec": ('{"schema": 1, "kind": "JobSpec", "name": "hand-fields", "gpus": 1, "memory": "lots"}', "memory"),
    "spec-inf": ('{"schema": 1, "kind": "JobSpec", "name": "hand-inf", "gpus": 1, "memory_bytes": 1e999}', "1e999"),
    "gpu": (None, "features"),  # built from a real GpuInfo below, with a feature that is not a string
    "status": ('{"schema": 1, "kind": "JobStatus", "state": "BOGUS"}', "state"),
}


def _families(pool: Pool, uuids: list[str], tag: str) -> dict[str, str]:
    """One key of every family that holds a record, named after ``tag``."""
    ks = pool.keys
    job = f"hand-{tag}"
    return {
        "nodes": ks.node(f"hand-{tag}"),
        "gpus": ks.gpu(f"hand-{tag}", f"GPU-hand-{tag}"),
        "jobs.spec": ks.job_spec(job),
        "jobs.status": ks.job_status(job),
        "allocations": ks.allocation("node-a", uuids[0], job),
        "directives": ks.directive(job),
        "acks": ks.ack(job),
        "telemetry": ks.telemetry(job),
        "checkpoints": ks.checkpoint(job),
        "usage": ks.usage(job),
    }


REPORTED_BY_TOP = {"gpus", "jobs.spec", "jobs.status", "allocations", "telemetry", "usage"}


@pytest.fixture(scope="module")
def garbage(live_pool: Pool, etcdctl: Etcdctl) -> dict[str, str]:
    """Write every garbage value under every family, plus garbage intents; returns {key: family}."""
    uuids = AGENT_UUIDS
    written: dict[str, str] = {}
    for tag, raw in GARBAGE.items():
        for family, key in _families(live_pool, uuids, tag).items():
            etcdctl("put", key, input=raw)  # from stdin: the deep value is too long for an argument
            written[key] = family
    # An intent's presence is what counts; its value is informative only. Garbage still cordons.
    etcdctl("put", live_pool.keys.cordon(uuids[1]), "{oops")
    etcdctl("put", live_pool.keys.drain("hand-node"), "[]")
    return written


def test_garbage_under_every_key_family_is_reported_and_skipped(live_pool: Pool, garbage: dict[str, str]) -> None:
    pool = live_pool
    uuids = AGENT_UUIDS
    # Scheduling goes on: a job submitted after the garbage is granted, away from the cordoned GPU.
    job = pool.submit("after-garbage", gpus=1, memory="10GiB", qos="guaranteed")
    job.wait_state(JobState.GRANTED)
    assert [a.gpu_uuid for a in job.allocations()] == [uuids[0]]

    opts = ["--endpoints", pool.endpoint, "--prefix", pool.keys.prefix]
    status_json, status_table, top, report = gpupool_many([
        ["status", "-o", "json", *opts], ["status", *opts], ["top", *opts], ["metrics", "report", *opts],
    ])
    for r in (status_json, status_table, top, report):
        assert r.returncode == EXIT_OK and "Traceback" not in r.stderr, explain(r)
    d = json.loads(status_json.stdout)
    problems = {p["key"]: p["message"] for p in d["problems"]}
    assert set(garbage) <= set(problems), sorted(set(garbage) - set(problems))
    assert all(("rewrite it" in m or "delete the key" in m) for k, m in problems.items() if k in garbage)
    assert uuids[1] in d["cordoned"] and "hand-node" in d["draining"]
    assert {j["name"] for j in d["jobs"]} == {"after-garbage"}
    assert "Problems" in status_table.stdout
    for r in (top, report):
        assert "malformed value" in r.stderr
        for key, family in garbage.items():
            if family in REPORTED_BY_TOP:
                assert key in r.stderr, f"{key} not reported:\n{explain(r)}"

    coordinator_log = pool.log("coordinator-c1")
    for key in garbage:
        assert f"skipping {key}:" in coordinator_log
    assert "Traceback" not in coordinator_log and "cycle failed" not in coordinator_log
    assert all(p.poll() is None for p in pool.procs), "the agent and the coordinator keep running"
    # Nothing hand-written was deleted behind the operator's back (the agent only cleans its own node).
    kvs, _ = pool.store.get_prefix(pool.keys.root())
    assert set(garbage) <= {kv.key for kv in kvs}
    pool.check()


def test_unusable_fields_are_named_in_the_problem(live_pool: Pool, garbage: dict[str, str], etcdctl: Etcdctl) -> None:
    pool = live_pool
    ks = pool.keys
    gpu = GpuInfo(uuid="GPU-hand-fields", node="hand-fields", index=0, model="T4-16GB", memory_bytes=16 << 30)
    bad_gpu = json.dumps({"schema": 1, "kind": "GpuInfo", **gpu.to_dict(), "features": ["bf16", None]})
    keys = {
        "spec": ks.job_spec("hand-fields"),
        "spec-inf": ks.job_spec("hand-inf"),
        "gpu": ks.gpu("hand-fields", "GPU-hand-fields"),
        "status": ks.job_status("hand-status"),
    }
    for name, key in keys.items():
        raw, _ = BAD_FIELDS[name]
        etcdctl("put", key, input=raw if raw is not None else bad_gpu)
    job = pool.submit("after-fields", gpus=1, memory="1GiB", qos="shared")
    job.wait_state(JobState.GRANTED)
    status, = gpupool_many([["status", "-o", "json", "--endpoints", pool.endpoint, "--prefix", ks.prefix]])
    problems = {p["key"]: p["message"] for p in json.loads(status.stdout)["problems"]}
    for name, key in keys.items():
        assert BAD_FIELDS[name][1] in problems.get(key, ""), f"{key}: {problems.get(key)!r}"
    # A spec that cannot be read gets no status: the coordinator writes nothing for it.
    assert pool.store.get(ks.job_status("hand-fields")) is None
    assert "Traceback" not in pool.log("coordinator-c1")


def test_the_agent_rewrites_its_own_keys_when_hand_edited(live_pool: Pool, etcdctl: Etcdctl) -> None:
    pool = live_pool
    uuid = AGENT_UUIDS[0]
    key = pool.keys.gpu("node-a", uuid)
    etcdctl("put", key, "{oops")  # also detaches the key from the agent's lease
    etcdctl("put", pool.keys.node("node-a"), '{"schema": 1}')

    def restored() -> bool:
        kv = pool.store.get(key)
        node = pool.store.get(pool.keys.node("node-a"))
        if kv is None or node is None or kv.lease == 0:
            return False
        try:
            return decode(key, kv.value, GpuInfo).uuid == uuid and b'"name"' in node.value
        except Exception:  # noqa: BLE001 - not rewritten yet
            return False

    wait_for(restored, what="the agent to rewrite its hand-edited keys")
    assert "malformed value" in pool.log("agent-0") and "Traceback" not in pool.log("agent-0")


def test_a_hand_edited_leader_and_term_do_not_stop_the_pool(live_pool: Pool, etcdctl: Etcdctl) -> None:
    pool = live_pool
    before = pool.wait_leader().term
    etcdctl("put", pool.keys.term(), "{oops")
    etcdctl("put", pool.keys.leader(), "{oops")  # no lease: removed, then a fresh election

    def new_leader() -> LeaderRecord | None:
        kv = pool.store.get(pool.keys.leader())
        if kv is None or kv.lease == 0:
            return None
        try:
            rec = decode(kv.key, kv.value, LeaderRecord)
        except Exception:  # noqa: BLE001 - still the garbage
            return None
        return rec if rec.term > before else None

    leader = wait_for(new_leader, what="a coordinator to lead again after the leader key was hand-edited")
    assert leader is not None and leader.id == "c1"
    job = pool.submit("after-leader", gpus=1, memory="1GiB", qos="shared")
    job.wait_state(JobState.GRANTED)
    assert pool.procs[1].poll() is None and "Traceback" not in pool.log("coordinator-c1")
    pool.check()


def test_impossible_specs_are_rejected_with_the_reason_not_left_pending(live_pool: Pool) -> None:
    pool = live_pool
    model = pool.submit("unknown-model", gpus=1, memory="1GiB", qos="shared", gpu_model="H999-80GB")
    too_big = pool.submit("too-big", gpus=1, memory="60GiB", qos="guaranteed")
    reason = model.wait_state(JobState.REJECTED).reason
    assert "H999-80GB" in reason and "A100-40GB" in reason  # names the wish and the models the pool has
    assert "GiB" in too_big.wait_state(JobState.REJECTED).reason
