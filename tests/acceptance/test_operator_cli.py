"""The operator's command line against a live pool: output formats, watch streams, and the job commands.

A real ``gpupool agent --simulate`` and coordinator (the module's ``live_pool``); every command
runs as its own process with stdout a pipe, as in ``gpupool status | cat``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import yaml
from scenarios.harness import Pool
from testkit import wait_for

from gpupool_sdk.cli.common import EXIT_FAILED, EXIT_NOT_FOUND, EXIT_OK
from gpupool_sdk.resources import GiB, JobState

from .cli import ROOT, explain, gpupool

BOX_DRAWING = re.compile("[\u2500-\u257f]")


def _opts(pool: Pool) -> list[str]:
    return ["--endpoints", pool.endpoint, "--prefix", pool.keys.prefix]


@pytest.fixture(scope="module")
def granted(live_pool: Pool) -> Pool:
    job = live_pool.submit("cli-bert", gpus=1, memory="12Gi", qos="guaranteed", owner="nlp")  # a Kubernetes quantity
    job.wait_state(JobState.GRANTED)
    waiting = live_pool.submit("cli-waiting", gpus=2, memory="30GiB", qos="shared", owner="cv")
    waiting.wait_state(JobState.PENDING)
    return live_pool


def test_status_piped_through_cat_has_no_box_drawing(granted: Pool) -> None:
    cmd = " ".join([sys.executable, "-m", "gpupool_sdk.cli.main", "status", *_opts(granted), "|", "cat"])
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=ROOT, timeout=90)
    assert r.returncode == 0, r.stderr
    assert not BOX_DRAWING.search(r.stdout), r.stdout
    assert "\x1b[" not in r.stdout, "no colour codes in a pipe"
    lines = r.stdout.splitlines()
    header = next(line for line in lines if line.startswith("JOB "))
    assert re.match(r"JOB\s{3,}STATE\s{3,}PRIO", header), header
    row = next(line for line in lines if line.startswith("cli-bert "))
    # aligned: the STATE column starts at the same offset in the header and the row
    assert row.index("GRANTED") == header.index("STATE")
    assert "cli-waiting" in r.stdout and "OWNER" not in header


@pytest.mark.parametrize("argv", [["top"], ["metrics", "report"], ["job", "list"]])
def test_other_tables_piped_through_cat_are_plain_aligned_columns(granted: Pool, argv: list[str]) -> None:
    """``top``, ``metrics report`` and ``job list`` print through the same table code as ``status``."""
    if argv[0] == "metrics":  # the report lists jobs with a usage record: the coordinator writes it after a grant
        wait_for(lambda: granted.store.get(granted.keys.usage("cli-bert")), 60, "cli-bert's usage record")
    cmd = " ".join([sys.executable, "-m", "gpupool_sdk.cli.main", *argv, *_opts(granted), "|", "cat"])
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=ROOT, timeout=90)
    assert r.returncode == 0, r.stderr
    assert not BOX_DRAWING.search(r.stdout) and "\x1b[" not in r.stdout, r.stdout
    header = next(line for line in r.stdout.splitlines() if line.startswith("JOB "))
    row = next(line for line in r.stdout.splitlines() if line.startswith("cli-bert "))
    assert re.match(r"JOB\s{3,}\S", header), header
    second = header.split()[1]  # the second column starts at the same offset in the header and the row
    assert row[header.index(second):].split()[0] == row.split()[1], (header, row)
    bare = subprocess.run(cmd.replace(" | cat", " --no-headers | cat"), shell=True, capture_output=True, text=True,
                          cwd=ROOT, timeout=90)
    assert bare.returncode == 0, bare.stderr
    assert not any(line.startswith("JOB ") for line in bare.stdout.splitlines()), bare.stdout
    assert any(line.startswith("cli-bert ") for line in bare.stdout.splitlines())


def test_status_wide_and_no_headers(granted: Pool) -> None:
    wide = gpupool("status", "-o", "wide", *_opts(granted))
    assert wide.returncode == 0, explain(wide)
    header = next(line for line in wide.stdout.splitlines() if line.startswith("JOB "))
    assert "OWNER" in header and "LEASE" in header and "PREEMPTIONS" in header
    bare = gpupool("status", "--no-headers", *_opts(granted))
    assert bare.returncode == 0, explain(bare)
    assert not any(line.startswith(("JOB ", "NODE ", "Jobs")) for line in bare.stdout.splitlines())
    assert any(line.startswith("cli-bert ") for line in bare.stdout.splitlines())


def test_status_yaml_parses_to_the_json_document(granted: Pool) -> None:
    y = gpupool("status", "-o", "yaml", *_opts(granted))
    j = gpupool("status", "-o", "json", *_opts(granted))
    assert y.returncode == 0 and j.returncode == 0, explain(y) + explain(j)
    doc = yaml.safe_load(y.stdout)
    assert {x["name"] for x in doc["jobs"]} == {x["name"] for x in json.loads(j.stdout)["jobs"]}
    bert = next(x for x in doc["jobs"] if x["name"] == "cli-bert")
    assert bert["memory_bytes"] == 12 * GiB and bert["state"] == "GRANTED"


@pytest.mark.parametrize("argv", [["status"], ["job", "list"], ["top"]])
def test_watch_json_is_one_object_per_line(granted: Pool, argv: list[str]) -> None:
    p = subprocess.Popen(
        [sys.executable, "-m", "gpupool_sdk.cli.main", *argv, "-w", "0.3", "-o", "json", *_opts(granted)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        assert p.stdout is not None
        docs = []
        deadline = time.monotonic() + 60
        while len(docs) < 3 and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            docs.append(json.loads(line))  # every line is a whole document
        assert len(docs) == 3, p.stderr.read() if p.stderr else ""
        assert all(isinstance(d, (dict, list)) for d in docs)
    finally:
        p.kill()
        p.wait(10)


def test_job_list_filters_and_formats(granted: Pool) -> None:
    r = gpupool("job", "list", "-o", "json", *_opts(granted))
    assert r.returncode == EXIT_OK, explain(r)
    rows = {x["name"]: x for x in json.loads(r.stdout)}
    assert rows["cli-bert"]["state"] == "GRANTED" and rows["cli-bert"]["owner"] == "nlp"
    assert rows["cli-waiting"]["state"] == "PENDING"
    r = gpupool("job", "list", "--state", "pending", "--no-headers", *_opts(granted))
    assert r.returncode == EXIT_OK, explain(r)
    assert [line.split()[0] for line in r.stdout.splitlines()] == ["cli-waiting"]
    r = gpupool("job", "list", "--owner", "nlp", "-o", "yaml", *_opts(granted))
    assert [x["name"] for x in yaml.safe_load(r.stdout)] == ["cli-bert"]


def test_job_describe_says_why_and_what(granted: Pool) -> None:
    r = gpupool("job", "describe", "cli-waiting", *_opts(granted))
    assert r.returncode == EXIT_OK, explain(r)
    assert "State:        PENDING" in r.stdout and "Reason:       queued" in r.stdout
    r = gpupool("job", "describe", "cli-bert", "-o", "yaml", *_opts(granted))
    doc = yaml.safe_load(r.stdout)
    assert doc["state"] == "GRANTED" and doc["live"] is True
    assert doc["lease"]["ttl_remaining_s"] > 0 and len(doc["allocations"]) == 1
    r = gpupool("job", "describe", "no-such-job", *_opts(granted))
    assert r.returncode == EXIT_NOT_FOUND and "no-such-job" in r.stderr


def test_job_describe_of_a_job_whose_spec_is_unusable_names_the_key_and_the_problem(granted: Pool) -> None:
    """A spec the coordinator skips (written by hand, or by a newer release: another schema) made
    ``describe`` say "no job ... in the pool", though ``status`` lists the key under Problems."""
    pool = granted
    lease = pool.store.grant_lease(60)
    key = pool.keys.job_spec("cli-newer")
    try:
        pool.store.put(key, '{"kind": "JobSpec", "schema": 99, "name": "cli-newer", "gpus": 1}', lease=lease)
        r = gpupool("job", "describe", "cli-newer", *_opts(pool))
        assert r.returncode == EXIT_NOT_FOUND, explain(r)
        assert key in r.stderr and "schema version 99" in r.stderr, explain(r)
    finally:
        pool.store.revoke_lease(lease)


def test_cancel_frees_the_slices_and_forget_removes_the_records(granted: Pool) -> None:
    pool = granted
    job = pool.submit("cli-cancel-me", gpus=1, memory="4Gi", qos="guaranteed")
    job.wait_state(JobState.GRANTED)
    assert gpupool("job", "forget", "cli-cancel-me", *_opts(pool)).returncode == EXIT_FAILED  # live: refused
    r = gpupool("job", "cancel", "cli-cancel-me", "-o", "json", *_opts(pool))
    assert r.returncode == EXIT_OK, explain(r)
    assert json.loads(r.stdout)["cancelled"] is True
    assert pool.store.get(pool.keys.job_spec("cli-cancel-me")) is None
    wait_for(lambda: not [a for a in pool.allocations() if a.job == "cli-cancel-me"], 30, "the slices freed")
    wait_for(lambda: job.lost, 30, "the job to see its lease lost")
    assert gpupool("job", "cancel", "cli-cancel-me", *_opts(pool)).returncode == EXIT_NOT_FOUND
    # The coordinator writes its usage record (it outlives the job): `list --all` shows it finished.
    wait_for(lambda: pool.store.get(pool.keys.usage("cli-cancel-me")), 60, "the usage record")
    rows = json.loads(gpupool("job", "list", "--all", "-o", "json", *_opts(pool)).stdout)
    assert {x["name"]: x["state"] for x in rows}["cli-cancel-me"] == "FINISHED"
    r = gpupool("job", "forget", "cli-cancel-me", *_opts(pool))
    assert r.returncode == EXIT_OK, explain(r)
    assert pool.store.get(pool.keys.usage("cli-cancel-me")) is None
    assert gpupool("job", "describe", "cli-cancel-me", *_opts(pool)).returncode == EXIT_NOT_FOUND
    assert gpupool("job", "forget", "cli-cancel-me", *_opts(pool)).returncode == EXIT_NOT_FOUND
