"""Signals before training, signals a process ignores, and two Ctrl-Cs (real processes, real signals).

* Before a training loop starts nothing can be checkpointed, and a process may be blocked in a C++
  call for good (DDP's rendezvous waiting for a rank that died), where no Python handler runs: the
  callback's recording handler kept rank 0 alive until torchrun's SIGKILL, 30 s later. Now the
  handler is installed where the loops begin, and a SIGTERM before that ends the process at once.
  Real etcd, coordinator, simulated agent, plain torchrun and ``gpupool run`` + torchrun (gloo, CPU).
* ``gpupool run -- torchrun``: torchrun exits 1 when it is signalled, whatever its ranks did; the
  launcher exits 75 all the same when rank 0 checkpointed (it says so on the channel) or was killed
  by the signal before it could (it left the channel without a release).
* A process started with SIGINT ignored (``nohup``, ``&`` in a non-interactive shell) keeps it
  ignored: the callback installs no handler over ``SIG_IGN``.
* A second Ctrl-C interrupts at once once the first was recorded; two SIGINTs delivered together
  are one (the kernel merges a pending signal), which checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from integrations.lightning.tests.conftest import ROOT, LivePool, wait_for

JOB = str(Path(__file__).with_name("early_signal_job.py"))
#: A bound on Lightning start-ups on a loaded 2-core machine, not a goal.
LONG = 600.0


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
            "0", JOB, *args]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_plain_torchrun_a_sigterm_in_ddp_setup_ends_rank_0_at_once_and_frees_the_lease(live_pool: LivePool) -> None:
    """Rank 1 fails (no grant: plain torchrun) while rank 0 waits in DDP's rendezvous; torchrun's SIGTERM
    ends rank 0 by the default action (it used to wait 30 s for torchrun's SIGKILL), and the job's keys go."""
    live_pool.start("node-a:2xA100-40GB")
    proc = live_pool.spawn("ddp", torchrun("--case", "ddp_setup", "--dir", str(live_pool.tmp), "--name", "ddp"))
    wait_for(lambda: (live_pool.tmp / "rank0-fit").exists(), LONG, what="rank 0 to lease and start fit")
    (live_pool.tmp / "release-rank1").write_text("go")
    assert live_pool.wait_exit(proc, "ddp", LONG) != 0
    log = live_pool.log("ddp")
    assert "rank 0 exported no grant" in log, log[-4000:]  # rank 1's ConfigError, the first failure
    assert "forcefully exiting" not in log, log[-4000:]  # torchrun's "Unable to shutdown process ... via 15"
    rank0 = re.search(r"rank\s+: 0 \(local_rank: 0\)\s+exitcode\s+: (-?\d+)", log)
    assert rank0 is not None and int(rank0.group(1)) == -signal.SIGTERM, log[-4000:]
    wait_for(lambda: live_pool.status("ddp") is None and not live_pool.allocations("ddp"), what="the job's keys to go")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gpupool_run_torchrun_a_sigterm_in_ddp_setup_stops_every_process_at_once_with_75(live_pool: LivePool) -> None:
    """`gpupool run -- torchrun ...` SIGTERMed while rank 0 waits in DDP's rendezvous (rank 1 held before it
    joins): the forwarded signal ends both ranks by its default action, torchrun stops (it exits 1 when
    signalled) without killing anything, the launcher needs no SIGKILL after --grace and exits 75, as for a
    script killed by the signal before it checkpointed (rank 0 left the channel without the release every
    Python exit sends), and the job's keys go. Before, torchrun waited 30 s for rank 0 and then SIGKILLed it."""
    live_pool.start("node-a:2xA100-40GB")
    run = live_pool.gpupool("run", "run", "--name", "rddp", "--gpus", "2", "--memory", "1GiB", "--grace", "300", "--",
                            *torchrun("--case", "ddp_setup", "--dir", str(live_pool.tmp)))
    wait_for(lambda: (live_pool.tmp / "rank0-fit").exists(), LONG, what="rank 0 to attach and start fit")
    run.send_signal(signal.SIGTERM)
    rc = live_pool.wait_exit(run, "run", LONG)
    log = live_pool.log("run")
    assert "forcefully exiting" not in log and "SIGKILL" not in log, log[-4000:]  # neither torchrun's nor the launcher's
    assert rc == 75, log[-4000:]
    assert "the script was killed before it checkpointed (the command ended with exit code 1)" in log, log[-4000:]
    wait_for(lambda: live_pool.status("rddp") is None and not live_pool.allocations("rddp"),
             what="the job's keys to go")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gpupool_run_torchrun_a_sigterm_while_training_checkpoints_and_exits_75(live_pool: LivePool) -> None:
    """`gpupool run -- torchrun ...` SIGTERMed while the rank trains: the rank checkpoints and exits 75, but
    torchrun, signalled too, exits 1; the launcher said "exit code 1 without a checkpoint" and exited 1 (no
    requeue by Slurm's RequeueExit=75). The script reports its checkpoint on the channel: 75."""
    live_pool.start("node-a:1xA100-40GB")
    paused = str(Path(__file__).with_name("paused_train.py"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--max-restarts",
           "0", paused, "--pause-dir", str(live_pool.tmp), "--pause-at=10", "--epochs", "3",
           "--out", str(live_pool.tmp / "job.pt")]
    run = live_pool.gpupool("trun", "run", "--name", "trun", "--memory", "1GiB", "--grace", "300", "--", *cmd)
    wait_for(lambda: (live_pool.tmp / "paused-at-10").exists(), LONG, what="the rank to be held at step 10")
    run.send_signal(signal.SIGTERM)
    rc = live_pool.wait_exit(run, "trun", LONG)
    log = live_pool.log("trun")
    assert (live_pool.tmp / "ckpt" / "trun-signal-step11.ckpt").exists(), log[-4000:]
    assert rc == 75 and "checkpointed (" in log and "the command ended with exit code 1" in log, log[-4000:]
    wait_for(lambda: live_pool.status("trun") is None and not live_pool.allocations("trun"),
             what="the job's keys to go")


def run_train(tmp_path: Path, send: str, ignore_sigint: bool = False) -> dict[str, Any]:
    """``early_signal_job.py --case train`` in a process of its own (started with SIGINT ignored, as
    ``nohup`` or ``&`` in a shell script leave it, when asked); its ``SIGNALS`` line."""
    cmd = shlex.join([sys.executable, JOB, "--case", "train", "--dir", str(tmp_path), "--send", send])
    # `trap '' INT` sets SIG_IGN, which exec keeps: the script starts with SIGINT ignored.
    script = ("trap '' INT; " if ignore_sigint else "") + "exec " + cmd
    env = _clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    res = subprocess.run(["sh", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=LONG, env=env)
    line = next((x for x in res.stdout.splitlines() if x.startswith("SIGNALS ")), None)
    assert res.returncode == 0 and line is not None, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(line.removeprefix("SIGNALS "))  # type: ignore[no-any-return]


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in ("GPUPOOL_RUN_SOCKET", "GPUPOOL_LEASED", "GPUPOOL_DEVICES", "GPUPOOL_RESUME_FROM", "GPUPOOL_JOB",
                "GPUPOOL_LEASE_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(var, None)
    return env


@pytest.mark.timeout(900)
def test_a_process_started_with_sigint_ignored_keeps_it_ignored(tmp_path: Path) -> None:
    got = run_train(tmp_path, "one", ignore_sigint=True)
    assert got["sigint_handler"] == repr(signal.SIG_IGN), got  # no handler of the callback over SIG_IGN
    assert got["outcome"] == "finished" and got["step"] == 8 and got["checkpoint"] is None, got


@pytest.mark.timeout(900)
@pytest.mark.parametrize("send", ["one", "together", "two"])
def test_ctrl_c_checkpoints_and_a_second_one_once_the_first_was_recorded_interrupts(send: str, tmp_path: Path) -> None:
    got = run_train(tmp_path, send)
    assert got["sigint_handler"] == "watch", got
    if send == "two":  # the second Ctrl-C: KeyboardInterrupt at once; Lightning's shutdown exits 1
        assert got["first_recorded"] and got["outcome"] == "exit 1" and got["step"] == 3, got
        assert got["checkpoint"] is None, got
    else:  # one Ctrl-C, or two merged into one: checkpoint at the next step boundary
        assert got["outcome"] == "preempted" and got["step"] == 4, got
        assert got["checkpoint"].endswith("early-signal-step4.ckpt"), got
