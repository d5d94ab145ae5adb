"""``gpupool status`` and ``gpupool job describe`` show a multi-node gang's members and their slices.

Two real ``gpupool agent --simulate`` processes declare node-a and node-b, a real coordinator
grants the gang; the gang's members are written as :meth:`PoolClient.join` writes them
(``jobs/{job}/members/{node}``, each on its own process's etcd lease). Every command runs as its
own process with stdout a pipe.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from scenarios.harness import JOB_TIMING, Job, Pool
from testkit import wait_for

from gpupool_sdk.cli.common import EXIT_OK
from gpupool_sdk.resources import GangMember, JobSpec, JobState
from gpupool_sdk.store import LeaseKeeper
from gpupool_sdk.store.keyspace import Keyspace

from .cli import explain, gpupool


@pytest.fixture(scope="module")
def two_nodes(etcd_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """A pool of its own: node-a and node-b (2 simulated A100s each, one agent process per node), one coordinator."""
    pool = Pool(etcd_endpoint, Keyspace(f"/gpupool-test/{uuid.uuid4().hex}"), tmp_path_factory.mktemp("gang-pool"))
    try:
        pool.gpus("node-a:2xA100-40GB:pcie")
        pool.gpus("node-b:2xA100-40GB:pcie")
        pool.coordinator("c1")
        pool.wait_leader()
        yield pool
    finally:
        pool.close()


def _opts(pool: Pool) -> list[str]:
    return ["--endpoints", pool.endpoint, "--prefix", pool.keys.prefix]


def _join(pool: Pool, job: Job, node: str, rank: int, lease: int) -> None:
    m = GangMember(job=job.name, node=node, node_rank=rank, nnodes=job.spec.nodes, hostname=socket.gethostname(),
                   pid=os.getpid() + rank, joined_at=time.time())
    assert pool.store.create(pool.keys.job_member(job.name, node), m, lease=lease)


def _status_json(pool: Pool) -> dict[str, Any]:
    r = gpupool("status", "-o", "json", *_opts(pool))
    assert r.returncode == EXIT_OK, explain(r)
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def test_status_and_describe_show_the_gangs_members_and_their_slices(two_nodes: Pool) -> None:
    pool = two_nodes
    gang = Job(pool, JobSpec(name="llm", gpus=4, nodes=2, memory="10Gi", owner="nlp"))
    pool.jobs.append(gang)
    _join(pool, gang, "node-a", 0, gang.lease)  # node rank 0 joins on the spec's lease, as PoolClient.join does

    # One of two members joined: the gang waits, and status says which node rank is missing.
    wait_for(lambda: "gang member" in (gang.status().reason if gang.status() else ""), 60, "the gang to wait")
    doc = _status_json(pool)
    job = next(j for j in doc["jobs"] if j["name"] == "llm")
    assert job["state"] == "PENDING" and job["nodes"] == 2
    assert [(m["node_rank"], m["joined"], m["node"]) for m in job["members"]] == [(0, True, "node-a"), (1, False, None)]
    r = gpupool("status", *_opts(pool))
    assert r.returncode == EXIT_OK, explain(r)
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("llm ")]
    assert ["llm", "0/2", "joined", "node-a", "-"] in rows and ["llm", "1/2", "missing", "-", "-"] in rows, r.stdout
    assert any(line.startswith("Gang members") for line in r.stdout.splitlines())

    # The second node's member joins on a lease of its own: the gang is granted 2 slices on each node.
    keeper = LeaseKeeper(pool.store, JOB_TIMING, on_lost=lambda e: None)
    pool.keepers.append(keeper)
    _join(pool, gang, "node-b", 1, keeper.start())
    gang.wait_state(JobState.GRANTED, timeout=60)

    doc = _status_json(pool)
    job = next(j for j in doc["jobs"] if j["name"] == "llm")
    members = {m["node"]: m for m in job["members"]}
    assert set(members) == {"node-a", "node-b"} and all(m["joined"] for m in members.values())
    for node, m in members.items():
        assert len(m["slices"]) == 2, m
        held = {a["gpu_uuid"] for a in job["allocations"] if a["node"] == node}
        assert {s["gpu_uuid"] for s in m["slices"]} == held
    assert members["node-b"]["node_rank"] == 1 and members["node-b"]["hostname"] == socket.gethostname()

    r = gpupool("status", *_opts(pool))
    assert r.returncode == EXIT_OK, explain(r)
    lines = r.stdout.splitlines()
    header = next(line for line in lines[lines.index("Gang members"):] if line.startswith("JOB "))
    a_row = next(line for line in lines if line.startswith("llm ") and "node-a/" in line and " 0/2 " in line)
    assert a_row.index("node-a") == header.index(" NODE ") + 1 and "node-a/0 node-a/1" in a_row, r.stdout
    assert any(line.startswith("llm ") and " 1/2 " in line and "node-b/0 node-b/1" in line for line in lines)
    jobs_row = next(line for line in lines if line.startswith("llm ") and "GRANTED" in line)
    assert "2 nodes x 2x10.0GiB" in jobs_row
    wide = gpupool("status", "-o", "wide", *_opts(pool))
    assert "HOST" in wide.stdout and socket.gethostname() in wide.stdout

    r = gpupool("job", "describe", "llm", *_opts(pool))
    assert r.returncode == EXIT_OK, explain(r)
    assert "Nodes:        2 (a multi-node gang" in r.stdout and "4 GPU(s), 2 per node" in r.stdout
    assert "Members:      node rank 0: node-a" in r.stdout and "node-a/0, node-a/1" in r.stdout
    assert "node rank 1: node-b" in r.stdout and "node-b/0, node-b/1" in r.stdout
    y = yaml.safe_load(gpupool("job", "describe", "llm", "-o", "yaml", *_opts(pool)).stdout)
    assert [(m["node_rank"], m["node"], len(m["slices"])) for m in y["members"]] == [(0, "node-a", 2), (1, "node-b", 2)]

    # An ordinary job has no members (and no section when no gang is in the pool).
    gang.release()
    keeper.stop(revoke=True)
    wait_for(lambda: not [a for a in pool.allocations() if a.job == "llm"], 60, "the gang's slices freed")
    single = pool.submit("single", gpus=1, memory="4Gi")
    single.wait_state(JobState.GRANTED, timeout=60)
    doc = _status_json(pool)
    assert next(j for j in doc["jobs"] if j["name"] == "single")["members"] == []
    assert "Gang members" not in gpupool("status", *_opts(pool)).stdout
