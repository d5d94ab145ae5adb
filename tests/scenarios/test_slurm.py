"""A pool job under Slurm: preempted by the pool, it exits 75, Slurm requeues it (``RequeueExit=75``)
and the rerun leases again once the room is back.

Runs a private Slurm (munged, slurmctld, slurmd on loopback, from Debian's ``slurm-wlm``) with a
configuration of its own; skipped where those programs are missing or the test is not root (slurmd
needs it). Slurm delays a requeued job's restart (its begin time), about two minutes here.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool_sdk.resources import JobSpec
from scenarios.harness import ROOT, Pool, wait_for

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.skipif(
    not all(shutil.which(p) for p in PROGRAMS) or os.geteuid() != 0,
    reason="needs Debian's slurm-wlm and munge (apt-get install slurmctld slurmd slurm-client munge) and root",
)]
REQUEUE_DEADLINE = 420.0  # Slurm's begin-time delay of a requeued job is about 120 s, on a shared machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_pidfile(path: Path) -> None:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, 15)
    except ProcessLookupError:
        return
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, 9)


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[dict[str, str]]:
    d = tmp_path / "slurm"
    for sub in ("state", "spool", "log"):
        (d / sub).mkdir(parents=True)
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = d / "munge.sock"
    subprocess.run(["munged", "--force", f"--socket={sock}", f"--key-file={key}", f"--pid-file={d / 'munged.pid'}",
                    f"--log-file={d / 'log/munged.log'}", f"--seed-file={d / 'munge.seed'}"], check=True)
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=gptest
SlurmctldHost={host}(127.0.0.1)
AuthType=auth/munge
AuthInfo=socket={sock}
SlurmUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}
SlurmctldPidFile={d / 'ctld.pid'}
SlurmdPidFile={d / 'd.pid'}
SlurmctldLogFile={d / 'log/ctld.log'}
SlurmdLogFile={d / 'log/d.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
ReturnToService=2
JobRequeue=1
RequeueExit=75
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=main Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    try:
        subprocess.run(["slurmctld", "-f", str(conf)], check=True, env=env)
        subprocess.run(["slurmd", "-f", str(conf)], check=True, env=env)
        wait_for(lambda: "idle" in subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                                                   env=env).stdout, 60, "the Slurm node to be idle")
        yield env
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True)
        for pidfile in ("d.pid", "ctld.pid", "munged.pid"):
            _kill_pidfile(d / pidfile)


def _job(env: dict[str, str], jid: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", jid, "-o"], capture_output=True, text=True, env=env).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def test_a_job_preempted_by_the_pool_is_requeued_by_slurm_and_leases_again(
    pool: Pool, slurm: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUPOOL_RUNTIME_DIR", str(tmp_path / "run"))
    pool.gpus("node-a:1xA100-40GB:pcie")
    pool.coordinator("c1")
    spec = JobSpec(name="slurm-job", gpus=1, qos="exclusive", priority=1, preempt_grace_s=30)
    out = tmp_path / "slurm-job.out"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"echo RUN restart=${{SLURM_RESTART_COUNT:-0}}\n"
        f"exec {sys.executable} {ROOT / 'tests/scenarios/client_proc.py'} {pool.endpoint} {pool.keys.prefix} "
        f"'{json.dumps(spec.to_dict())}'\n"
    )
    script.chmod(0o755)
    jid = subprocess.run(
        ["sbatch", "--parsable", "--requeue", "--open-mode=append", "-o", str(out), "-D", str(ROOT), str(script)],
        capture_output=True, text=True, env={**slurm, "PYTHONUNBUFFERED": "1"}, check=True,
    ).stdout.strip().split(";")[0]

    def text() -> str:
        return out.read_text() if out.exists() else ""

    wait_for(lambda: "GRANTED node-a/" in text(), 120, f"Slurm job {jid} to lease node-a ({text()!r})")
    urgent = pool.client(JobSpec(name="urgent", gpus=1, qos="exclusive", priority=10))
    pool.wait_output(urgent, "GRANTED", timeout=120)
    wait_for(lambda: "PREEMPTED" in text(), 60, "the Slurm job to be preempted by the pool")
    # Exit 75 ("preempted, run me again"): Slurm requeues the job by itself.
    wait_for(lambda: _job(slurm, jid).get("Restarts") == "1", 120, f"Slurm to requeue job {jid}: {_job(slurm, jid)}")
    urgent.terminate()
    assert urgent.wait(60) == 0
    # Slurm starts the requeued job after its begin-time hold (about two minutes).
    wait_for(lambda: text().count("GRANTED node-a/") == 2, REQUEUE_DEADLINE, f"the rerun to lease again ({text()!r})")
    assert "RUN restart=1" in text()
    subprocess.run(["scancel", jid], env=slurm, check=True)
