"""After ``fit`` the process's own signal handlers are back in place, however the fit ended.

Lightning's signal connector restores, at the end of ``fit``, the handlers it found at its start:
the callback's SignalWatch handler among them. In a process that lives on after ``fit``
(``exit_on_preempt=False``, a notebook, a sweep of fits) that stale handler recorded a later
SIGTERM and swallowed it, instead of the process's own handler (the default action: terminate).

Each case runs a real Lightning Trainer (Lightning's own ``BoringModel``, CPU) in a process of its
own with the callback on an in-memory lease (the FakeLease of test_callback_logic.py: no pool is
needed for what is tested here), ends the fit one way, then gets a real SIGTERM from this process.
The case processes are forked from one host process that imported torch and both Lightning
packages once (a Lightning import is ~5 s of CPU; the suite runs on two cores); a fork starts with
the host's signal dispositions, which are Python's defaults, as a fresh interpreter's are.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from integrations.lightning.tests.conftest import ROOT, wait_for

pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("signals_after_fit_host")]

#: The host script: sets up the process's own handlers, fits, reports, then waits for a signal.
SCRIPT = textwrap.dedent('''
    import json, os, signal, sys, time

    scenario, handler, tmp = sys.argv[1], sys.argv[2], sys.argv[3]
    if handler == "own":
        def own(signum, frame):
            print("OWN HANDLER", signum, flush=True)
            os._exit(3)
        signal.signal(signal.SIGTERM, own)
    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    before = {s: signal.getsignal(s) for s in SIGNALS}

    if scenario.endswith("_lightning"):  # the `lightning` distribution's Trainer
        scenario = scenario.removesuffix("_lightning")
        import lightning.pytorch as pl
        from lightning.pytorch.demos.boring_classes import BoringModel
    else:
        import pytorch_lightning as pl
        from pytorch_lightning.demos.boring_classes import BoringModel
    from gpupool_lightning import GpuPoolCallback, PoolLeaseLostError
    from integrations.lightning.tests.test_callback_logic import FakeClient, FakeLease

    lease = FakeLease("host")
    pool = GpuPoolCallback(memory="1GiB", name="host", client=FakeClient(lease), checkpoint_dir=tmp,
                           exit_on_preempt=False)

    armed = []  # per fit: the watch handles SIGTERM when training starts

    class Act(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            armed.append(pool.runtime.signals.owns(signal.getsignal(signal.SIGTERM)))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step != 3:
                return
            if scenario == "directive":
                pool.runtime.inbox.put(lease.directive())
            elif scenario == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            elif scenario == "raised":
                raise RuntimeError("the model raised")
            elif scenario == "lost":
                lease.lose("lease revoked by the test")

    def fit():
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=8,
                             limit_val_batches=0, callbacks=[pool, Act()], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=tmp)
        try:
            trainer.fit(BoringModel())
        except RuntimeError:
            return "raised", trainer
        except PoolLeaseLostError:
            return "lost", trainer
        return ("preempted" if pool.preempted else "finished"), trainer

    outcome, trainer = fit()
    if scenario == "twice":  # a second run of a Trainer with the same callback (lease kept)
        outcome, trainer = fit()
    after = {s: signal.getsignal(s) for s in SIGNALS}
    print(json.dumps({"outcome": outcome, "step": trainer.global_step, "armed": armed,
                      "restored": [signal.Signals(s).name for s in SIGNALS if after[s] == before[s]],
                      "in_place": {signal.Signals(s).name: repr(after[s]) for s in SIGNALS}}), flush=True)
    print("READY", flush=True)
    time.sleep(600)
    print("SIGNAL SWALLOWED", flush=True)
''')

CASES = {
    # scenario: (process's own SIGTERM handler, how fit ends)
    "directive": ("own", "preempted"),
    "sigterm": ("default", "preempted"),  # an own handler would be chained (run) by this first SIGTERM
    "finished": ("default", "finished"),
    "twice": ("own", "finished"),
    "raised": ("own", "raised"),
    "raised_lightning": ("own", "raised"),
    "lost": ("default", "lost"),
}


#: Imports torch and both Lightning packages once, then forks a process per case line read from
#: stdin (``scenario handler tmpdir``): the child runs SCRIPT with its output in ``tmpdir/host.log``;
#: the host prints ``{"pid": ...}`` when it forked and ``{"pid": ..., "rc": ...}`` when the child ended.
HOST = textwrap.dedent('''
    import json, os, sys
    import pytorch_lightning, lightning.pytorch  # noqa: F401 - the cost every case shares
    import pytorch_lightning.demos.boring_classes, lightning.pytorch.demos.boring_classes  # noqa: F401
    import gpupool_lightning  # noqa: F401
    import integrations.lightning.tests.test_callback_logic  # noqa: F401
    script = sys.stdin.readline()
    code = compile(json.loads(script), "signals_case", "exec")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        scenario, handler, tmp = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                fd = os.open(os.path.join(tmp, "host.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(0)
                sys.argv = ["signals_case", scenario, handler, tmp]
                exec(code, {"__name__": "__main__"})
            finally:
                os._exit(0)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "rc": os.waitstatus_to_exitcode(status)}), flush=True)
''')


class Host:
    """The host process of one test module (on one worker: the module's xdist group)."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        for var in ("GPUPOOL_RUN_SOCKET", "GPUPOOL_LEASED", "GPUPOOL_DEVICES", "GPUPOOL_RESUME_FROM", "GPUPOOL_JOB",
                    "GPUPOOL_LEASE_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):  # fmt: skip
            env.pop(var, None)
        self.proc = subprocess.Popen([sys.executable, "-c", HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=ROOT, env=env, start_new_session=True)  # fmt: skip
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._send(json.dumps(SCRIPT))
        assert self.next(300).get("ready"), "the host did not start"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put({"host_exited": self.proc.wait()})

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def next(self, timeout: float) -> dict[str, Any]:
        got = self.lines.get(timeout=timeout)
        assert "host_exited" not in got, f"the host process exited: {got}"
        return got

    def fork(self, scenario: str, handler: str, tmp: Path) -> int:
        self._send(f"{scenario} {handler} {tmp}")
        return int(self.next(60)["pid"])

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    h = Host()
    try:
        yield h
    finally:
        h.close()


def run_host(host: Host, scenario: str, handler: str, tmp_path: Path) -> tuple[dict[str, Any], int, str]:
    """Fork a case, wait until its fit returned, SIGTERM it; its report, return code and output."""
    out_path = tmp_path / "host.log"
    pid = host.fork(scenario, handler, tmp_path)
    try:
        wait_for(lambda: out_path.exists() and "READY" in out_path.read_text(), 300,
                 what=f"the {scenario} fit to return")  # fmt: skip
        os.kill(pid, signal.SIGTERM)
        try:
            done = host.next(120)  # a bound: the default action or os._exit is immediate
        except queue.Empty:
            pytest.fail(f"the SIGTERM after fit was swallowed: the process still runs\n{out_path.read_text()}")
        assert done["pid"] == pid, done
        rc = int(done["rc"])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # its own session (setsid): whatever is left of the case
    text = out_path.read_text()
    report = next(json.loads(line) for line in text.splitlines() if line.startswith("{"))
    return report, rc, text


@pytest.mark.parametrize("scenario", list(CASES))
def test_after_fit_a_sigterm_reaches_the_processs_own_handler(host: Host, scenario: str, tmp_path: Path) -> None:
    handler, outcome = CASES[scenario]
    report, rc, text = run_host(host, scenario, handler, tmp_path)
    assert report["outcome"] == outcome, text
    # During each fit the callback's handler was the one in place (again at the second fit).
    assert report["armed"] == [True] * (2 if scenario == "twice" else 1), text
    # Every signal the callback handled has the process's own handler back, none the callback's.
    assert report["restored"] == ["SIGTERM", "SIGINT", "SIGUSR1"], text
    if handler == "default":
        assert rc == -signal.SIGTERM, text  # the default action: terminated by the signal
    else:
        assert rc == 3 and "OWN HANDLER 15" in text, text
    assert "SIGNAL SWALLOWED" not in text


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)


WATCH = '''
    import os, signal, sys, time
    from gpupool_sdk.runtime.signals import SignalWatch
    seen = []
    watch = SignalWatch(seen.append)
'''


def test_a_stale_watch_handler_put_back_over_sig_dfl_lets_the_default_action_happen() -> None:
    """What Lightning does: save the watch's handler while installed, put it back after uninstall."""
    proc = _run_python(WATCH + '''
    watch.install((signal.SIGTERM,))
    saved = signal.getsignal(signal.SIGTERM)
    watch.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    signal.signal(signal.SIGTERM, saved)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    print("SWALLOWED", seen, flush=True)
    ''')
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr


def test_a_stale_watch_handler_forwards_to_the_previous_handler_and_puts_it_back() -> None:
    proc = _run_python(WATCH + '''
    got = []
    def own(signum, frame):
        got.append(signum)
    signal.signal(signal.SIGUSR1, own)
    watch.install((signal.SIGUSR1,))
    os.kill(os.getpid(), signal.SIGUSR1)  # installed: recorded, and the previous handler chained
    assert seen == [signal.SIGUSR1] and got == [signal.SIGUSR1], (seen, got)
    saved = signal.getsignal(signal.SIGUSR1)
    watch.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is own
    signal.signal(signal.SIGUSR1, saved)  # a framework puts the stale handler back
    os.kill(os.getpid(), signal.SIGUSR1)
    assert seen == [signal.SIGUSR1], "a stale watch must not record"
    assert got == [signal.SIGUSR1] * 2, got
    assert signal.getsignal(signal.SIGUSR1) is own, "the previous handler is back in place"
    # Installed again over its own stale handler: the handler found first stays the one chained.
    signal.signal(signal.SIGUSR1, saved)
    watch.install((signal.SIGUSR1,))
    os.kill(os.getpid(), signal.SIGUSR1)
    assert seen == [signal.SIGUSR1] * 2 and got == [signal.SIGUSR1] * 3, (seen, got)
    watch.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is own
    print("OK", flush=True)
    ''')
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
