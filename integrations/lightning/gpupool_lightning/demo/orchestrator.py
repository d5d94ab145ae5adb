"""``gpupool demo``: etcd + coordinator + simulated agent + small Lightning jobs, with a timeline.

Scenario (default ``demo-node:2xA100-40GB:nvlink``): two shared jobs fill both GPUs
(``etl-low`` priority 0 and ``tuning`` priority 3); once ``etl-low`` is training, the guaranteed
job ``urgent`` (priority 10) arrives. The coordinator preempts the lowest-priority job, which
checkpoints at a step boundary, acks, exits 75; its ``gpupool run`` launcher queues it again,
and it resumes from its checkpoint when a GPU frees up and finishes.

Every process the demo starts is stopped on the way out (also on Ctrl-C).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.table import Table

from gpupool_sdk.errors import GpupoolError
from gpupool_sdk.store.security import SECURITY_ENV_VARS


@dataclass
class DemoJob:
    """One demo job and when it starts (``after``: start once that job is training)."""

    name: str
    priority: int
    qos: str = "shared"
    memory: str = "30GiB"
    epochs: int = 3
    samples: int = 96
    batch_size: int = 8
    step_sleep: float = 0.08
    after: str | None = None
    after_delay_s: float = 1.0


DEFAULT_JOBS: tuple[DemoJob, ...] = (
    DemoJob("etl-low", priority=0, epochs=4),
    DemoJob("tuning", priority=3, epochs=2),
    DemoJob("urgent", priority=10, qos="guaranteed", epochs=2, after="etl-low"),
)


@dataclass
class JobTrack:
    """What the demo saw of one job."""

    job: DemoJob
    proc: subprocess.Popen[str] | None = None
    queued_at: float | None = None
    run_started: float | None = None
    waited_s: float = 0.0
    ran_s: float = 0.0
    preempted: int = 0
    resumed: int = 0
    training: bool = False
    exit_code: int | None = None
    result: dict[str, Any] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)


_RUN_RE = re.compile(r"^\[gpupool run\] (.*)$")


class Demo:
    """Runs the demo; :meth:`run` returns the process exit code.

    Args:
        simulate: the agent's simulated GPUs (``node:NxMODEL:link``).
        jobs: the jobs to run.
        timeout_s: give up (and fail) after this long.
        console: where the timeline and summary go.
        workdir: checkpoints and logs (default: a temporary directory, removed afterwards).
    """

    def __init__(
        self,
        simulate: str = "demo-node:2xA100-40GB:nvlink",
        jobs: tuple[DemoJob, ...] = DEFAULT_JOBS,
        timeout_s: float = 110.0,
        console: Console | None = None,
        workdir: str | None = None,
    ) -> None:
        self.simulate = simulate
        self.jobs = jobs
        self.timeout_s = timeout_s
        self.console = console or Console(highlight=False, width=None if sys.stdout.isatty() else 120)
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="gpupool-demo-")
        self.workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.prefix = f"/gpupool-demo/{uuid.uuid4().hex[:8]}"
        self.t0 = time.monotonic()
        self.events: queue.Queue[tuple[float, str, str]] = queue.Queue()
        self.tracks = {j.name: JobTrack(j) for j in jobs}
        self.procs: list[tuple[str, subprocess.Popen[str]]] = []
        self.etcd: Any = None
        self._stop = threading.Event()

    # -- output --------------------------------------------------------------------------------
    def say(self, who: str, msg: str, style: str = "") -> None:
        t = time.monotonic() - self.t0
        tag = f"[{style}]{who:>12}[/{style}]" if style else f"{who:>12}"
        self.console.print(f"[dim]{t:6.1f}s[/dim] {tag}  {msg}")

    # -- processes -------------------------------------------------------------------------------
    def _spawn(self, label: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        log_path = self.workdir / f"{label}.log"
        proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            # The demo's etcd is its own plaintext one: the operator's TLS/auth settings do not apply.
            env={**{k: v for k, v in os.environ.items() if k not in SECURITY_ENV_VARS}, **(env or {})},
            start_new_session=True,
            cwd=self.workdir,
        )
        self.procs.append((label, proc))
        threading.Thread(target=self._pump, args=(label, proc.stdout, log_path), daemon=True).start()
        return proc

    def _pump(self, label: str, stream: IO[str] | None, log_path: Path) -> None:
        if stream is None:
            return
        with open(log_path, "a") as log:
            for line in stream:
                log.write(line)
                log.flush()
                self.events.put((time.monotonic(), label, line.rstrip("\n")))

    def _gpupool(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "gpupool_sdk.cli.main", *args]

    def _start_pool(self) -> str:
        from gpupool_sdk.store.launcher import EtcdServer

        self.etcd = EtcdServer(data_dir=None, name="gpupool-demo")
        self.etcd.start(timeout=60)
        ep = str(self.etcd.endpoint)
        self.say("etcd", f"real etcd on {ep} (pid {self.etcd.pid}), prefix {self.prefix}", "cyan")
        common = ["--endpoints", ep, "--prefix", self.prefix]
        self._spawn(
            "coordinator",
            self._gpupool(
                "coordinator", *common, "--ttl", "3", "--loop-wait", "0.2", "--preempt-grace", "40",
                "--aging", "100000", "--log-level", "warning",
                # The same cap as the etcd it runs on (EtcdServer starts etcd with --max-txn-ops).
                "--etcd-max-txn-ops", str(self.etcd.max_txn_ops or 128),
            ),
        )
        self.say("coordinator", "started (ttl 3s, loop 0.2s)", "cyan")
        self._spawn("agent", self._gpupool("agent", *common, "--simulate", self.simulate))
        self.say("agent", f"started with simulated GPUs {self.simulate!r} (declared, not real)", "cyan")
        return ep

    def _wait_for_gpus(self, ep: str, deadline: float) -> None:
        from gpupool_sdk.store import EtcdSecurity, EtcdStore
        from gpupool_sdk.store.keyspace import Keyspace

        store = EtcdStore(ep, keyspace=Keyspace(self.prefix), security=EtcdSecurity())
        try:
            while time.monotonic() < deadline:
                kvs, _ = store.get_prefix(store.keys.gpus_prefix())
                if kvs:
                    self.say("agent", f"{len(kvs)} GPU(s) registered in etcd", "cyan")
                    return
                self._check_infra()
                time.sleep(0.2)
        finally:
            store.close()
        raise GpupoolError("the agent registered no GPU in time; see its log in the demo's work directory")

    def _check_infra(self) -> None:
        for label, proc in self.procs:
            if label in ("coordinator", "agent") and proc.poll() is not None:
                tail = (self.workdir / f"{label}.log").read_text()[-2000:]
                raise GpupoolError(f"the {label} exited with code {proc.returncode}:\n{tail}")

    def _start_job(self, ep: str, track: JobTrack) -> None:
        j = track.job
        cmd = self._gpupool(
            "run", "--name", j.name, "--memory", j.memory, "--qos", j.qos, "--priority", str(j.priority),
            "--endpoints", ep, "--prefix", self.prefix, "--checkpoint-dir", str(self.workdir / "ckpt"),
            "--", sys.executable, "-m", "gpupool_lightning.demo.job", "--epochs", str(j.epochs),
            "--samples", str(j.samples), "--batch-size", str(j.batch_size), "--step-sleep", str(j.step_sleep),
            "--memory", j.memory, "--progress", "--cpu",
        )
        # The simulated node's slices become this machine's visible devices; the jobs still train on the CPU.
        track.proc = self._spawn(j.name, cmd, env={"GPUPOOL_NODE": self.simulate.split(":", 1)[0]})
        self.say(j.name, f"submitted: priority {j.priority}, {j.qos}, {j.memory}", "bold")

    # -- events ------------------------------------------------------------------------------------
    def _on_line(self, at: float, label: str, line: str) -> None:
        track = self.tracks.get(label)
        if track is None:
            if "Traceback" in line or "ERROR" in line:
                self.say(label, line, "red")
            return
        track.log.append(line)
        m = _RUN_RE.match(line)
        if m:
            msg = m.group(1)
            state, _, reason = msg.partition(": ")
            if state in ("PENDING", "GRANTED", "PREEMPTING", "SUSPENDED", "REJECTED", "FAILED", "DONE"):
                if state in ("PREEMPTING", "SUSPENDED") or (state == "PENDING" and reason):
                    self.say(label, f"{state}: {reason}", "yellow" if state == "PENDING" else "magenta")
            elif msg.startswith("queueing"):
                track.queued_at = at
                self.say(label, "queued" + (" again" if track.preempted else ""), "yellow")
            elif msg.startswith("granted"):
                if track.queued_at is not None:
                    track.waited_s += at - track.queued_at
                    track.queued_at = None
                track.run_started = at
                if "resuming from" in msg:
                    track.resumed += 1
                self.say(label, msg, "green")
            elif msg.startswith(("preempted;", "lease lost")) or msg.startswith("finished"):
                if track.run_started is not None:
                    track.ran_s += at - track.run_started
                    track.run_started = None
                    track.training = False
                if msg.startswith("finished"):
                    self.say(label, msg, "green")
                else:
                    track.preempted += 1
                    self.say(label, "script exited 75 (checkpointed, acked, released); gpupool run is " + msg.split(";", 1)[-1].strip(), "magenta")
            return
        if line.startswith("GPUPOOL_PROGRESS "):
            info = json.loads(line.split(" ", 1)[1])
            if info.get("event") == "train_start":
                track.training = True
                resumed = f" (resumed at step {info['step']})" if info.get("step") else ""
                self.say(label, f"training{resumed}", "green")
            return
        if line.startswith("GPUPOOL_RESULT "):
            track.result = json.loads(line.split(" ", 1)[1])
            r = track.result
            if r.get("preempted"):
                self.say(label, f"preempt directive: checkpointed at step {r['global_step']} -> {Path(r['checkpoint']).name}", "magenta")
            return
        if "Traceback" in line or "Error" in line:
            self.say(label, line, "red")

    # -- main -----------------------------------------------------------------------------------
    def run(self) -> int:
        """Run the whole demo; returns 0 when every job finished and the preemption was seen."""
        deadline = self.t0 + self.timeout_s
        self.console.rule("[bold]gpupool demo[/bold]: an elastic GPU pool on loopback")
        ok = False

        def _interrupt(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt

        # The demo owns its process (a CLI command): SIGTERM and SIGINT both mean "stop and clean up".
        previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            ep = self._start_pool()
            self._wait_for_gpus(ep, deadline)
            started: set[str] = set()
            trigger_at: dict[str, float] = {}
            while time.monotonic() < deadline:
                for track in self.tracks.values():
                    j = track.job
                    if j.name in started:
                        continue
                    if j.after is None:
                        self._start_job(ep, track)
                        started.add(j.name)
                    elif self.tracks[j.after].training:
                        trigger_at.setdefault(j.name, time.monotonic() + j.after_delay_s)
                        if time.monotonic() >= trigger_at[j.name]:
                            self._start_job(ep, track)
                            started.add(j.name)
                try:
                    at, label, line = self.events.get(timeout=0.1)
                    self._on_line(at, label, line)
                    while True:
                        at, label, line = self.events.get_nowait()
                        self._on_line(at, label, line)
                except queue.Empty:
                    pass
                self._check_infra()
                if len(started) == len(self.tracks) and all(
                    t.proc is not None and t.proc.poll() is not None for t in self.tracks.values()
                ):
                    time.sleep(0.2)
                    while not self.events.empty():
                        self._on_line(*self.events.get_nowait())
                    break
            else:
                self.say("demo", f"timed out after {self.timeout_s:.0f}s", "red")
            for t in self.tracks.values():
                t.exit_code = t.proc.poll() if t.proc is not None else None
            ok = all(t.exit_code == 0 for t in self.tracks.values()) and any(
                t.preempted and t.resumed for t in self.tracks.values()
            )
        except KeyboardInterrupt:
            self.say("demo", "interrupted: stopping everything", "red")
        except GpupoolError as exc:
            self.say("demo", f"failed: {exc}", "red")
        finally:
            try:
                self._cleanup()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        self._summary(ok)
        if self._tmp is not None and ok:
            self._tmp.cleanup()
        return 0 if ok else 1

    def _cleanup(self) -> None:
        # Job launchers first (SIGINT: they stop their script and release the lease), then the pool.
        order = sorted(self.procs, key=lambda lp: lp[0] in ("coordinator", "agent"))
        for label, proc in order:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGINT if label in self.tracks else signal.SIGTERM)
        for _label, proc in order:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.etcd is not None:
            self.etcd.stop()

    def _summary(self, ok: bool) -> None:
        table = Table(title="gpupool demo: per-job summary")
        for col in ("job", "prio", "exit", "waited s", "ran s", "preempted", "resumed", "steps",
                    "data/fwd/bwd/opt/ckpt %", "GPU-s"):
            table.add_column(col, justify="right" if col not in ("job",) else "left")
        for t in self.tracks.values():
            phases = t.result.get("phases", {}).get("phase_s", {})
            total = sum(phases.values()) or 1.0
            split = "/".join(f"{100 * phases.get(p, 0.0) / total:.0f}" for p in ("data", "forward", "backward", "optimizer", "checkpoint"))
            table.add_row(
                t.job.name, str(t.job.priority), str(t.exit_code), f"{t.waited_s:.1f}", f"{t.ran_s:.1f}",
                str(t.preempted), str(t.resumed), str(t.result.get("global_step", "-")), split, f"{t.ran_s:.1f}",
            )
        self.console.print(table)
        took = time.monotonic() - self.t0
        verdict = "[green]demo OK[/green]" if ok else "[red]demo FAILED[/red] (logs: " + str(self.workdir) + ")"
        self.console.print(f"{verdict} in {took:.1f}s")


def run_demo(simulate: str = "demo-node:2xA100-40GB:nvlink", timeout_s: float = 110.0, workdir: str | None = None) -> int:
    """Run ``gpupool demo`` in this process; returns its exit code.

    Example:
        >>> # run_demo()   # starts etcd, a coordinator, an agent and three jobs; about a minute
    """
    return Demo(simulate=simulate, timeout_s=timeout_s, workdir=workdir).run()
