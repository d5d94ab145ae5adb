"""Issue 11 end to end: a README-style script (fit, then save; EarlyStopping(strict) and a monitored
ModelCheckpoint beside the callback) under real preemptions, real signals, real crashes.

Real etcd, coordinator, agent (simulated GPU), `gpupool run` and Lightning trainers on the CPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gpupool_sdk.client import PoolClient
from gpupool_sdk.resources import JobSpec
from integrations.lightning.tests.conftest import ROOT, LivePool, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SCRIPT = str(ROOT / "examples" / "readme_train.py")
#: readme_train.py held at chosen steps until the callback has a signal or directive to act on.
PAUSED = str(Path(__file__).with_name("paused_train.py"))
ARGS = ["--epochs", "3"]
STEPS = 3 * 192 // 8
#: A whole run (or two, with a restart) of Lightning start-ups on a loaded 2-core machine: a bound, not a goal.
LONG = 600.0


def run_script(pool: LivePool, label: str, run_args: list[str], *args: str, pause_at: tuple[int, ...] = ()
               ) -> subprocess.Popen[Any]:
    """``gpupool run RUN_ARGS -- python readme_train.py ARGS``; with ``pause_at``, held at those steps
    (paused_train.py) until the signal or directive the test sends has reached the callback."""
    script = [PAUSED, "--pause-dir", str(pool.tmp), *(f"--pause-at={s}" for s in pause_at)] if pause_at else [SCRIPT]
    return pool.gpupool(label, "run", *run_args, "--", sys.executable, *script, *ARGS, *args)


def wait_paused(pool: LivePool, step: int) -> None:
    """Until the script is held inside training step ``step`` (its handlers installed, training under way)."""
    wait_for(lambda: (pool.tmp / f"paused-at-{step}").exists(), LONG, what=f"the script to be held at step {step}")


def baseline(pool: LivePool, tmp_path: Path) -> dict[str, Any]:
    p = pool.spawn("base", [sys.executable, SCRIPT, *ARGS, "--name", "base", "--memory", "30GiB",
                            "--out", str(tmp_path / "base.pt")])
    assert pool.wait_exit(p, "base") == 0, pool.log("base")
    return torch.load(tmp_path / "base.pt")  # type: ignore[no-any-return]


def assert_same(a: dict[str, Any], b_path: Path) -> None:
    b = torch.load(b_path)
    assert a["global_step"] == b["global_step"] == STEPS
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k


def children(pid: int, pattern: str = "") -> list[int]:
    """Child processes of ``pid`` (whose command line matches ``pattern``)."""
    args = ["pgrep", "-P", str(pid)] + (["-f", pattern] if pattern else [])
    out = subprocess.run(args, capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_preempted_readme_script_exits_75_resumes_and_matches_an_uninterrupted_run(
    live_pool: LivePool, tmp_path: Path
) -> None:
    live_pool.start("node-a:1xA100-40GB")
    base = baseline(live_pool, tmp_path)
    run = run_script(live_pool, "low", ["--name", "low", "--memory", "30GiB"], "--out", str(tmp_path / "low.pt"),
                     pause_at=(10,))
    wait_paused(live_pool, 10)  # training, and still training when the directive lands
    client = PoolClient(endpoints=live_pool.endpoint, prefix=live_pool.keys.prefix)
    try:
        lease = client.acquire(JobSpec(name="urgent", memory="30GiB", qos="guaranteed", priority=10), timeout=120)
        wait_for(lambda: "preempted; queueing again" in live_pool.log("low"), what="low to be re-queued")
        # The script saved nothing after its partial fit: the save line appears once, at the end.
        assert "SAVED" not in live_pool.log("low")
        lease.release()
    finally:
        client.close()
    assert live_pool.wait_exit(run, "low", LONG) == 0, live_pool.log("low")
    log = live_pool.log("low")
    assert log.count("SAVED") == 1 and "Traceback" not in log, log
    assert_same(base, tmp_path / "low.pt")


def test_sigterm_to_the_script_and_to_gpupool_run_checkpoint_requeue_and_match(
    live_pool: LivePool, tmp_path: Path
) -> None:
    live_pool.start("node-a:1xA100-40GB")
    base = baseline(live_pool, tmp_path)
    out = str(tmp_path / "job.pt")
    # Each signal lands while the script is held inside a known mid-epoch step (paused_train.py):
    # training under way, the callback's handlers in place, the job far from its end.
    run = run_script(live_pool, "job", ["--name", "job", "--memory", "30GiB"], "--out", out, pause_at=(10, 30))
    wait_paused(live_pool, 10)
    # 1. SIGTERM to the script alone (a kubelet/OOM-style signal to the training process): it
    #    checkpoints at the next step boundary, exits 75, and the launcher queues it again.
    (script,) = children(run.pid, "paused_train")  # not the client's helper process, also a child
    os.kill(script, signal.SIGTERM)
    wait_for(lambda: "preempted; queueing again" in live_pool.log("job"), what="the job to be re-queued")
    assert (live_pool.tmp / "ckpt" / "job-signal-step11.ckpt").exists(), live_pool.log("job")
    # 2. SIGTERM to `gpupool run` (scancel, pod deletion) once the resumed script trains again:
    #    forwarded, checkpoint, launcher exits 75.
    wait_paused(live_pool, 30)
    run.send_signal(signal.SIGTERM)
    assert live_pool.wait_exit(run, "job", LONG) == 75, live_pool.log("job")
    assert (live_pool.tmp / "ckpt" / "job-signal-step31.ckpt").exists(), live_pool.log("job")
    assert not children(run.pid, "paused_train")
    wait_for(lambda: not live_pool.allocations("job"), what="the job's slices to be released")
    # 3. The outer system runs it again: it resumes and finishes with the same weights.
    again = run_script(live_pool, "job-2", ["--name", "job", "--memory", "30GiB"], "--out", out)
    assert live_pool.wait_exit(again, "job-2", LONG) == 0, live_pool.log("job-2")
    assert_same(base, Path(out))


def test_sigterm_inside_validation_resumes_into_that_validation_with_early_stopping_strict(
    live_pool: LivePool, tmp_path: Path
) -> None:
    """A SIGTERM that lands while ``fit`` validates (the end of epoch 1) is acted on after that validation
    batch. The checkpoint used to resume into an epoch end whose validation never ran: the default
    ``EarlyStopping`` (it checks at the train epoch's end) raised for the missing ``val_loss`` at every
    restart, and the job failed. The resumed run validates again and ends like an uninterrupted one."""
    live_pool.start("node-a:1xA100-40GB")
    base = baseline(live_pool, tmp_path)
    out = str(tmp_path / "val.pt")
    run = live_pool.gpupool("val", "run", "--name", "val", "--memory", "30GiB", "--max-restarts", "1", "--",
                            sys.executable, PAUSED, "--pause-dir", str(live_pool.tmp), "--pause-in-validation", "1",
                            *ARGS, "--out", out)
    wait_for(lambda: (live_pool.tmp / "paused-in-validation-1").exists(), LONG, what="the script to validate")
    (script,) = children(run.pid, "paused_train")
    os.kill(script, signal.SIGTERM)
    assert live_pool.wait_exit(run, "val", LONG) == 0, live_pool.log("val")
    log = live_pool.log("val")
    assert "preempted; queueing again" in log and "crashed" not in log, log
    assert (live_pool.tmp / "ckpt" / "val-signal-step48.ckpt").exists(), log
    assert_same(base, Path(out))


def test_a_crash_is_restarted_from_the_checkpoint_and_a_crash_past_the_budget_shows_failed(
    live_pool: LivePool, tmp_path: Path
) -> None:
    live_pool.start("node-a:1xA100-40GB")
    base = baseline(live_pool, tmp_path)
    # Crash once at step 30 after a SIGTERM-free run: the restart resumes from the newest
    # checkpoint (none from the pool yet: it starts over) and finishes with the same weights.
    marker = tmp_path / "crashed-once"
    run = run_script(live_pool, "crash", ["--name", "crash", "--memory", "30GiB", "--max-restarts", "1"],
                     "--crash-at", "30", "--crash-marker", str(marker), "--out", str(tmp_path / "crash.pt"))
    assert live_pool.wait_exit(run, "crash", LONG) == 0, live_pool.log("crash")
    assert "crashed (exit code 1); restart 1/1" in live_pool.log("crash")
    assert_same(base, tmp_path / "crash.pt")
    # Past the budget: FAILED with the exit code and the reason in `gpupool status -o json`.
    marker2 = tmp_path / "crashed-twice"
    run = run_script(live_pool, "doomed", ["--name", "doomed", "--memory", "30GiB", "--max-restarts", "0"],
                     "--crash-at", "5", "--crash-marker", str(marker2), "--out", str(tmp_path / "doomed.pt"))
    assert live_pool.wait_exit(run, "doomed", LONG) == 1, live_pool.log("doomed")
    status = subprocess.run([sys.executable, "-m", "gpupool_sdk.cli.main", "status", "-o", "json"],
                            env=live_pool.env, capture_output=True, text=True, timeout=60, check=True)
    results = {r["job"]: r for r in json.loads(status.stdout)["results"]}
    assert results["doomed"]["state"] == "FAILED" and results["doomed"]["exit_code"] == 1
    assert "exit code 1" in results["doomed"]["reason"]
    assert "crash" not in results  # a finished run leaves no FAILED result


def test_a_preempt_at_an_epochs_last_batch_is_acted_on_before_a_long_validation(
    live_pool: LivePool, tmp_path: Path
) -> None:
    """A directive seen at an epoch's last training batch used to wait for the whole validation (and the
    next training step): a validation longer than the job's preempt grace lost the lease (forced
    preemption, emergency checkpoint). It is acted on after the first validation batch; the checkpoint
    resumes into that validation and the run ends like an uninterrupted one."""
    live_pool.start("node-a:1xA100-40GB")
    base = baseline(live_pool, tmp_path)
    out = str(tmp_path / "last.pt")
    # 24 steps an epoch: held inside step 23, the last of epoch 0; 4 validation batches of 2 s > grace 3 s.
    run = live_pool.gpupool("last", "run", "--name", "last", "--memory", "30GiB", "--preempt-grace", "3", "--",
                            sys.executable, PAUSED, "--pause-dir", str(live_pool.tmp), "--pause-at", "23",
                            "--validation-sleep", "2", *ARGS, "--out", out)
    wait_paused(live_pool, 23)
    client = PoolClient(endpoints=live_pool.endpoint, prefix=live_pool.keys.prefix)
    try:
        lease = client.acquire(JobSpec(name="urgent", memory="30GiB", qos="guaranteed", priority=10), timeout=120)
        wait_for(lambda: "queueing again" in live_pool.log("last"), LONG, what="last to be re-queued")
        lease.release()
    finally:
        client.close()
    assert live_pool.wait_exit(run, "last", LONG) == 0, live_pool.log("last")
    log = live_pool.log("last")
    assert "lease lost" not in log and "emergency" not in log, log
    assert (live_pool.tmp / "ckpt" / "last-preempt-step24.ckpt").exists(), log
    assert_same(base, Path(out))


def test_a_script_that_refuses_the_launchers_spec_is_not_restarted(live_pool: LivePool, tmp_path: Path) -> None:
    """A callback asking another priority than `gpupool run --priority` stops at once with a ConfigError
    naming both; the launcher used to count that as a crash and queue, lease and run it again
    --max-restarts times. It exits 2 (bad usage) after the first run, naming the field."""
    live_pool.start("node-a:1xA100-40GB")
    run = live_pool.gpupool("mism", "run", "--name", "mism", "--memory", "1GiB", "--", sys.executable, SCRIPT,
                            "--priority", "5", "--out", str(tmp_path / "m.pt"))
    assert live_pool.wait_exit(run, "mism", LONG) == 2, live_pool.log("mism")
    log = live_pool.log("mism")
    assert log.count("running:") == 1 and "crashed" not in log, log
    assert "priority" in log.splitlines()[-1] and "not restarted" in log, log
    wait_for(lambda: live_pool.status("mism") is None, what="the job's keys to go")


def test_a_script_killed_by_a_signal_is_reported_as_such_and_restarted(live_pool: LivePool, tmp_path: Path) -> None:
    """Issue 18, item 5: the OOM killer's SIGKILL is a crash to restart, not "finished with exit code -9"."""
    live_pool.start("node-a:1xA100-40GB")
    marker = tmp_path / "killed-once"
    code = (f"import os, pathlib, signal; m = pathlib.Path({str(marker)!r})\n"
            "if not m.exists():\n    m.write_text('x'); os.kill(os.getpid(), signal.SIGKILL)\n")
    run = live_pool.gpupool("oom", "run", "--name", "oom", "--memory", "1GiB", "--max-restarts", "1", "--",
                            sys.executable, "-c", code)
    assert live_pool.wait_exit(run, "oom", LONG) == 0, live_pool.log("oom")
    log = live_pool.log("oom")
    assert "crashed (killed by SIGKILL); restart 1/1" in log and "exit code -9" not in log


def test_sigterm_to_a_queued_gpupool_run_stops_it_at_once(live_pool: LivePool, tmp_path: Path) -> None:
    """A launcher still waiting in the queue has nothing to checkpoint: SIGTERM ends it (75), no job left."""
    live_pool.start("node-a:1xA100-40GB")
    client = PoolClient(endpoints=live_pool.endpoint, prefix=live_pool.keys.prefix)
    try:
        client.acquire(JobSpec(name="holder", memory="30GiB", qos="guaranteed", priority=10), timeout=LONG)
        run = run_script(live_pool, "waiter", ["--name", "waiter", "--memory", "30GiB"], "--out", str(tmp_path / "w.pt"))
        wait_for(lambda: "PENDING" in live_pool.log("waiter"), LONG, what="the launcher to be queued")
        run.send_signal(signal.SIGTERM)
        assert live_pool.wait_exit(run, "waiter", LONG) == 75, live_pool.log("waiter")
        assert "nothing to checkpoint" in live_pool.log("waiter")
        wait_for(lambda: live_pool.status("waiter") is None, what="the queued job's keys to go")
    finally:
        client.close()


def test_a_script_preempted_past_max_preemptions_gives_up(live_pool: LivePool) -> None:
    """Every exit 75 is a preemption: released, queued again, counted; past ``--max-preemptions`` it gives up (1)."""
    live_pool.start("node-a:1xA100-40GB")
    run = live_pool.gpupool("again", "run", "--name", "again", "--memory", "1GiB", "--max-preemptions", "1", "--",
                            sys.executable, "-c", "import sys; sys.exit(75)")
    assert live_pool.wait_exit(run, "again", LONG) == 1, live_pool.log("again")
    log = live_pool.log("again")
    assert log.count("running:") == 2 and "preempted; queueing again (preemption 1)" in log, log
    assert "preempted; giving up after 1 preemptions" in log and "queueing again (preemption 2)" not in log, log
    wait_for(lambda: live_pool.status("again") is None, what="the job's keys to go")


@pytest.mark.parametrize("case", ["before_its_handler", "past_the_grace"])
def test_sigterm_to_gpupool_run_that_kills_the_script_before_a_checkpoint_exits_75(
    case: str, live_pool: LivePool, tmp_path: Path
) -> None:
    """A SIGTERM to the launcher exits 75 ("run again") also when the script dies of it before it could
    checkpoint: killed by the forwarded signal (still starting, no handler yet) or by SIGKILL after
    ``--grace`` (a script that ignores it). Its newest checkpoint stands; the outer system requeues."""
    live_pool.start("node-a:1xA100-40GB")
    marker = tmp_path / "started"
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if case == "past_the_grace" else ""
    code = f"import pathlib, signal, time; {ignore}pathlib.Path({str(marker)!r}).write_text('x'); time.sleep(600)"
    run = live_pool.gpupool("early", "run", "--name", "early", "--memory", "1GiB", "--grace", "1", "--",
                            sys.executable, "-c", code)
    wait_for(marker.exists, LONG, what="the script to start")
    run.send_signal(signal.SIGTERM)
    assert live_pool.wait_exit(run, "early", LONG) == 75, live_pool.log("early")
    killed = "SIGTERM" if case == "before_its_handler" else "SIGKILL"
    assert f"the script was killed by {killed} before it checkpointed" in live_pool.log("early"), live_pool.log("early")
    wait_for(lambda: live_pool.status("early") is None and not live_pool.allocations("early"), what="the job's keys to go")
