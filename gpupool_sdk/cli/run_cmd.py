"""``gpupool run [spec options] -- python train.py ...``: queue, run on the grant, re-run after preemption.

**Decision:** the launcher holds the job's lease and the script attaches to it over a local
Unix socket (``$GPUPOOL_RUN_SOCKET``; see :mod:`gpupool_sdk.runtime.run_channel`), so the
script's ``GpuPoolCallback``/``PoolSession`` never submits a second spec. After the script exits
with 75 (preempted, checkpointed) or the lease is lost, the launcher releases what is left,
queues again under the same job name and re-runs the script, which resumes from the job's last
acknowledged checkpoint (``$GPUPOOL_RESUME_FROM``). Ctrl-C stops the script and releases everything.

Elastic jobs (``--min-gpus``/``--max-gpus``): after the script acked a ``resize`` and exited
(75, or non-zero from torchrun, whose agent reports a worker's 75 as a failure) the launcher keeps
the lease, waits for the coordinator's re-grant on it and runs the command again with
``GPUPOOL_DEVICES`` set to the new slice count (``torchrun --nproc-per-node "$GPUPOOL_DEVICES"``
inside ``sh -c``: one rank per slice). A resize counts as neither a preemption nor a crash. The
coordinator writes the release and the re-grant in one transaction, so the job's status goes from
PREEMPTING straight to GRANTED. When a preemption superseded the resize (the job is SUSPENDED at
the resize's ack), the launcher releases the lease and queues again, as after any preemption.

Signals: SIGTERM, SIGINT or SIGUSR1 to the launcher (Kubernetes eviction, ``scancel``, Ctrl-C,
Slurm's ``--signal``) are forwarded to the script's process group; the script checkpoints at its
next step boundary and exits 75; the launcher waits up to ``--grace`` seconds (then SIGKILL),
releases everything and exits 75 itself, so that the outer system (Slurm ``--requeue``, a
Kubernetes ``restartPolicy: OnFailure`` Job) runs it again and it resumes.

Crashes: a script that exits non-zero (or is killed by a signal, as the kernel's OOM killer
does) is restarted from its newest checkpoint up to ``--max-restarts`` times with exponential
backoff (torchrun's flag name). Preemptions (exit 75) do not count against that budget. A
script whose callback refused the launcher's spec (its own arguments contradict the flags, a
``ConfigError`` it reports on the channel) is not restarted: every run would stop the same way.

Exit codes: the script's own when it finished (0); 75 when it was stopped by a signal (it
checkpointed, or died of the signal or of the SIGKILL after ``--grace`` before it could: run it
again to resume from its newest checkpoint; also when a launcher in between, such as torchrun, exits
1 when signalled: the script reports its checkpoint on the channel, and a script killed before it
leaves its connection without the release every Python exit sends); the script's own failing code when it exited non-zero
while stopping, or once ``--max-restarts`` is spent (128+N for a signal N); 2 for bad flags or a
script that refused them; 3 when
etcd is unreachable.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click

from gpupool_sdk.cli.common import EXIT_USAGE, endpoints_option, etcd_security_options, prefix_option
from gpupool_sdk.errors import ConfigError, LeaseLostError
from gpupool_sdk.resources import JobSpec, JobState
from gpupool_sdk.runtime.env import (
    CKPT_DIR_ENV,
    DEVICES_ENV,
    EX_TEMPFAIL,
    JOB_ENV,
    LEASE_ID_ENV,
    LEASED_ENV,
    RESUME_ENV,
    RUN_SOCKET_ENV,
    job_slug,
)
from gpupool_sdk.store.records import JobResult
from gpupool_sdk.store.security import EtcdSecurity

_PYTHONS = re.compile(r"^(python[0-9.]*|pypy[0-9.]*)$")


def job_name_of(command: tuple[str, ...] | list[str]) -> str | None:
    """The job name a command implies: its script's file name, or ``-m``'s module; None for ``python -c``.

    Example:
        >>> job_name_of(["python", "-m", "my_pkg.train", "--lr", "3e-4"])
        'train'
    """
    args = list(command)
    for i, arg in enumerate(args):
        if arg.endswith(".py"):
            return job_slug(arg)
        if arg == "-m" and i + 1 < len(args):
            return job_slug(args[i + 1].rsplit(".", 1)[-1])
        if arg == "-c":
            return None
    head = os.path.basename(args[0]) if args else ""
    if not head or _PYTHONS.match(head):
        return None
    return job_slug(head)


def describe_exit(rc: int) -> str:
    """``-9`` -> ``"killed by SIGKILL"``; ``3`` -> ``"exit code 3"``."""
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def shell_code(rc: int) -> int:
    """The launcher's own exit code for a script's return code (``-N`` -> ``128+N``, as shells do)."""
    return 128 - rc if rc < 0 else rc


def _signal_group(proc: subprocess.Popen[Any], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


def _stop_child(proc: subprocess.Popen[Any], grace_s: float = 30.0, signum: int = signal.SIGTERM) -> int:
    """Signal the script's process group, wait ``grace_s``, then SIGKILL it. Returns its return code."""
    if proc.poll() is None:
        _signal_group(proc, signum)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    # Whatever the script left behind in its group (DataLoader workers, ranks) goes with it.
    _signal_group(proc, signal.SIGKILL)
    return int(proc.returncode)


@click.command(
    "run",
    context_settings={"ignore_unknown_options": False, "allow_interspersed_args": False},
)
@click.option("--name", default=None, help="Job name (default: $GPUPOOL_JOB, the script's file name, or -m's module).")
@click.option("--gpus", type=int, default=1, show_default=True, help="Slices wanted.")
@click.option("--memory", default=None, help="Memory per slice, e.g. 20GiB or 20Gi (required unless --qos exclusive).")
@click.option("--qos", type=click.Choice(["shared", "guaranteed", "exclusive"]), default="shared", show_default=True)
@click.option("--priority", type=int, default=0, show_default=True)
@click.option("--nodes", type=int, default=1, show_default=True,
              help="Multi-node gang: run one `gpupool run` per node (srun, torchrun's hosts); --gpus is the total. "
                   "Node rank and count come from the launcher's environment (docs/multinode.md).")
@click.option("--node-rank", type=int, default=None,
              help="This node's rank in a --nodes gang (default from SLURM_NODEID / GROUP_RANK / PET_NODE_RANK / NODE_RANK).")
@click.option("--min-gpus", type=int, default=None, help="Elastic job: fewest slices it can train on (with --max-gpus).")
@click.option("--max-gpus", type=int, default=None,
              help="Elastic job: most slices it can use; the pool grows and shrinks it at step boundaries, keeping "
                   "its lease (the script is restarted from its checkpoint on the new slices).")
@click.option("--compute-share", type=float, default=1.0, show_default=True)
@click.option("--feature", "features", multiple=True, help="Required GPU feature (repeatable): bf16, fp8, nvlink...")
@click.option("--gpu-model", default=None, help="Restrict to one catalog model, e.g. H100-80GB.")
@click.option("--preempt-grace", "preempt_grace_s", type=float, default=None,
              help="Seconds the job gets to checkpoint after a preempt directive (JobSpec preempt_grace_s).")
@click.option("--min-runtime", "min_runtime_s", type=float, default=None,
              help="Seconds after a grant during which the job is not preempted (JobSpec min_runtime_s).")
@click.option("--checkpoint-dir", default=None, help="Checkpoint directory passed to the script ($GPUPOOL_CHECKPOINT_DIR).")
@click.option("--acquire-timeout", type=float, default=None, help="Seconds to wait in the queue per attempt.")
@click.option("--max-restarts", type=int, default=3, show_default=True,
              help="Restart a crashed script (non-zero exit, killed by a signal) this many times from its newest "
                   "checkpoint, with backoff. Preemptions do not count.")
@click.option("--max-preemptions", type=int, default=100, show_default=True, help="Give up after this many preemptions.")
@click.option("--retention", "retention_s", type=float, default=86400.0, show_default=True,
              help="Seconds a FAILED result stays listed in `gpupool status` (results/{job}, on its own lease).")
@click.option("--grace", "grace_s", type=float, default=30.0, show_default=True,
              help="Seconds the script gets to checkpoint after the launcher forwards SIGTERM/SIGINT/SIGUSR1.")
@endpoints_option
@etcd_security_options
@prefix_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(
    name: str | None,
    gpus: int,
    memory: str | None,
    qos: str,
    priority: int,
    nodes: int,
    node_rank: int | None,
    min_gpus: int | None,
    max_gpus: int | None,
    compute_share: float,
    features: tuple[str, ...],
    gpu_model: str | None,
    preempt_grace_s: float | None,
    min_runtime_s: float | None,
    checkpoint_dir: str | None,
    acquire_timeout: float | None,
    max_restarts: int,
    max_preemptions: int,
    retention_s: float,
    grace_s: float,
    endpoints: str | None,
    security: EtcdSecurity,
    prefix: str | None,
    command: tuple[str, ...],
) -> None:
    """Queue a job, run COMMAND on the granted GPUs, run it again after each preemption or crash.

    The launcher holds the job's lease; the script's GpuPoolCallback/PoolSession attaches to it.
    The launcher's flags are the job's spec: a script whose callback asks for different values
    stops with an error naming both (drop them from one side).

    Example: gpupool run --memory 20GiB --priority 5 -- python examples/lightning_train.py --epochs 3
    """
    if memory is None and qos != "exclusive":
        raise ConfigError("--memory", f"{qos} jobs must say how much memory per slice they need, e.g. --memory 20GiB "
                          "(the launcher leases before the script starts, so it cannot read the script's callback)")
    for flag, value in (("--max-restarts", max_restarts), ("--max-preemptions", max_preemptions)):
        if value < 0:
            raise ConfigError(flag, f"must be >= 0, got {value}")
    if not (math.isfinite(grace_s) and grace_s > 0):
        raise ConfigError("--grace", f"must be a positive number of seconds, got {grace_s}")
    if not (math.isfinite(retention_s) and retention_s >= 1):
        raise ConfigError("--retention", f"must be at least 1 second, got {retention_s}")
    if acquire_timeout is not None and not (math.isfinite(acquire_timeout) and acquire_timeout > 0):
        raise ConfigError(
            "--acquire-timeout", f"must be a positive number of seconds, got {acquire_timeout}; omit it to wait indefinitely"
        )
    job = name or os.environ.get(JOB_ENV) or job_name_of(command)
    if not job:
        raise ConfigError("--name", f"cannot name the job after `{shlex.join(command)}`; pass --name NAME")
    extra: dict[str, Any] = {}
    if preempt_grace_s is not None:
        extra["preempt_grace_s"] = preempt_grace_s
    if min_runtime_s is not None:
        extra["min_runtime_s"] = min_runtime_s
    if nodes != 1:
        extra["nodes"] = nodes
    if min_gpus is not None:
        extra["min_gpus"] = min_gpus
    if max_gpus is not None:
        extra["max_gpus"] = max_gpus
    spec = JobSpec(
        name=job,
        gpus=gpus,
        memory=memory or 0,
        qos=qos,
        priority=priority,
        compute_share=compute_share,
        features=tuple(features),
        gpu_model=gpu_model,
        **extra,
    )
    sys.exit(run_job(spec, list(command), endpoints=endpoints, prefix=prefix, checkpoint_dir=checkpoint_dir,
                     acquire_timeout=acquire_timeout, max_restarts=max_restarts, max_preemptions=max_preemptions,
                     grace_s=grace_s, security=security, retention_s=retention_s, node_rank=node_rank))


#: Signals the launcher forwards to the script's process group as "checkpoint and stop".
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def run_job(
    spec: JobSpec,
    command: list[str],
    endpoints: str | None = None,
    prefix: str | None = None,
    checkpoint_dir: str | None = None,
    acquire_timeout: float | None = None,
    max_restarts: int = 3,
    max_preemptions: int = 100,
    grace_s: float = 30.0,
    echo: Any = None,
    security: EtcdSecurity | None = None,
    backoff_s: float = 1.0,
    retention_s: float = 86400.0,
    node_rank: int | None = None,
) -> int:
    """The loop behind ``gpupool run``: acquire, run, re-queue on exit 75 or lease loss, restart crashes.

    Returns:
        The exit code for the launcher (see the module docstring).
    """
    from gpupool_sdk.client import PoolClient
    from gpupool_sdk.runtime.run_channel import RunChannelServer
    from gpupool_sdk.runtime.sharing import launcher_environment

    say = echo or (lambda msg: click.echo(f"[gpupool run] {msg}", err=True))
    client = PoolClient(endpoints=endpoints, prefix=prefix, security=security)
    sockdir = tempfile.mkdtemp(prefix="gpupool-run-")
    os.chmod(sockdir, 0o700)
    preemptions = crashes = resizes = 0
    lease: Any = None
    proc: subprocess.Popen[Any] | None = None
    stop_signal: list[int] = []
    previous: dict[signal.Signals, Any] = {}

    def on_signal(signum: int, frame: Any) -> None:
        # Forwarded to the script's group; the loop below waits for it to checkpoint. With no
        # script running (queued, or between runs) there is nothing to save: stop waiting now.
        first = not stop_signal
        stop_signal.append(signum)
        if proc is not None and proc.poll() is None:
            _signal_group(proc, signum)
            if first:
                say(f"{signal.Signals(signum).name}: asking the script to checkpoint (grace {grace_s:.0f}s)")
            return
        raise _StopWaiting(signum)

    def requeue(why: str) -> bool:
        """After a preemption or a lost lease: release, count it; False once --max-preemptions is spent."""
        nonlocal lease, preemptions
        lease.release()
        lease = None
        preemptions += 1
        if preemptions > max_preemptions:
            say(f"{why}; giving up after {max_preemptions} preemptions")
            return False
        say(f"{why}; queueing again (preemption {preemptions})")
        return True

    is_main = threading.current_thread() is threading.main_thread()
    if is_main:
        for signum in FORWARDED:
            previous[signum] = signal.signal(signum, on_signal)
    try:
        while True:
            if stop_signal:
                say("stopped by a signal before the script ran; nothing to checkpoint")
                return EX_TEMPFAIL
            began = time.monotonic()
            lease = _lease_for(client, spec, lease, acquire_timeout, node_rank, say)
            ck = client.resume_info(spec.name)
            resume = ck.path if ck is not None and ck.path and Path(ck.path).exists() else None
            devices = lease.device_indices()
            say(
                f"granted after {time.monotonic() - began:.1f}s: devices {','.join(devices) or '-'}, lease "
                f"{lease.etcd_lease_hex} (etcdctl lease timetolive {lease.etcd_lease_hex} --keys)"
                + (f", resuming from {resume}" if resume else "")
            )
            sock = os.path.join(sockdir, f"run-{preemptions + crashes + resizes}.sock")
            server = RunChannelServer(lease, sock, resume, spec=spec)
            env = dict(os.environ)
            env.update({JOB_ENV: spec.name, RUN_SOCKET_ENV: sock, LEASED_ENV: "1",
                        DEVICES_ENV: str(len(devices) or spec.gpus), LEASE_ID_ENV: lease.etcd_lease_hex})
            if devices:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
            # MPS limits (CUDA reads them once, at its start) and the time-slicing plan: docs/sharing.md.
            env.update(launcher_environment(lease, client))
            if security is not None:  # TLS and auth given as --etcd-* flags reach the script's own connections
                env.update(security.environment())
            if endpoints:
                env["GPUPOOL_ENDPOINTS"] = endpoints
            if prefix:
                env["GPUPOOL_PREFIX"] = prefix
            if checkpoint_dir:
                env[CKPT_DIR_ENV] = checkpoint_dir
            if resume:
                env[RESUME_ENV] = resume
            else:
                env.pop(RESUME_ENV, None)
            say(f"running: {shlex.join(command)}")
            # Its own process group: signals reach the script and its workers, not the launcher twice.
            proc = subprocess.Popen(command, env=env, start_new_session=True)
            rc = _wait(proc, stop_signal, grace_s)
            proc = None
            if stop_signal:
                server.wait_hang_ups(5.0)  # how the script ended: checkpointed, released, or killed
            server.close()
            lost = bool(lease.lost)
            if stop_signal:
                if not lost and rc == EX_TEMPFAIL and server.preempt_acked.is_set():
                    lease.wait_released(timeout=5.0)
                lease.release()
                lease = None
                if rc == EX_TEMPFAIL:
                    say(f"stopped by {signal.Signals(stop_signal[0]).name}: checkpointed; exit {EX_TEMPFAIL} "
                        "(run again to resume)")
                    return EX_TEMPFAIL
                if rc == 0:
                    say(f"the script finished (exit code 0) as {signal.Signals(stop_signal[0]).name} arrived")
                    return 0
                if server.stopped_checkpoint:
                    # The script checkpointed and exited 75; a launcher in between exited otherwise
                    # (torchrun exits 1 when it is signalled itself).
                    say(f"stopped by {signal.Signals(stop_signal[0]).name}: checkpointed ({server.stopped_checkpoint}); "
                        f"the command ended with {describe_exit(rc)}; exit {EX_TEMPFAIL} (run again to resume)")
                    return EX_TEMPFAIL
                if rc < 0:
                    # Killed before it could checkpoint: by the forwarded signal itself (no handler
                    # yet: still starting, or a script without the SDK) or by SIGKILL after --grace.
                    # Stopped from outside all the same: its newest checkpoint stands, run it again.
                    say(f"stopped by {signal.Signals(stop_signal[0]).name}: the script was {describe_exit(rc)} "
                        f"before it checkpointed; exit {EX_TEMPFAIL} (run again to resume from its newest checkpoint)")
                    return EX_TEMPFAIL
                if server.hung_up.is_set():
                    # The same under a launcher in between: the script's rank died without its exit
                    # cleanup (the signal's default action, before training), and torchrun exits 1.
                    say(f"stopped by {signal.Signals(stop_signal[0]).name}: the script was killed before it "
                        f"checkpointed (the command ended with {describe_exit(rc)}); exit {EX_TEMPFAIL} (run again "
                        "to resume from its newest checkpoint)")
                    return EX_TEMPFAIL
                say(f"stopped by {signal.Signals(stop_signal[0]).name}: the script ended with {describe_exit(rc)} "
                    "without a checkpoint")
                return shell_code(rc) or 1
            if rc not in (0, EX_TEMPFAIL) and server.resize_acked.is_set() and not lost:
                # The script acked a resize and checkpointed, then its launcher (torchrun, whose
                # agent reports a worker's 75 as a failure) exited non-zero: a resize all the same.
                say(f"the command ended with {describe_exit(rc)} after the script acked a resize")
                rc = EX_TEMPFAIL
            if rc == EX_TEMPFAIL and not lost and server.resize_acked.is_set():
                # An elastic resize: the coordinator re-places the job under this same lease;
                # wait for that grant and run the script again on it (no release, no queueing).
                resizes += 1
                say(f"resized; waiting for the re-grant on lease {lease.etcd_lease_hex} (resize {resizes})")
                regranted = lease.wait_for(_regranted_since(server.acked_at), timeout=acquire_timeout)
                st = lease.status
                if regranted and not lease.lost and st is not None and st.state is JobState.GRANTED:
                    continue
                if regranted and not lease.lost and st is not None and st.state is JobState.SUSPENDED:
                    # A preemption superseded the resize: the coordinator took the slices back at the
                    # resize's ack (its checkpoint stands). A preemption like any other: queue again.
                    say(f"preempted during the resize ({st.reason})")
                    if not requeue("preempted"):
                        return 1
                    continue
                say("no re-grant after the resize" + (f" ({lease.lost_reason})" if lease.lost else "")
                    + "; queueing again")
                lost = True
            if rc not in (0, EX_TEMPFAIL) and server.preempt_acked.is_set() and not stop_signal:
                # The script acked a preempt and checkpointed, then its launcher (torchrun, whose
                # agent reports a worker's 75 as a failure) exited non-zero: a preemption all the same.
                say(f"the command ended with {describe_exit(rc)} after the script acked a preemption")
                rc = EX_TEMPFAIL
            if rc == EX_TEMPFAIL or (rc != 0 and lost):
                why = "preempted" if rc == EX_TEMPFAIL else f"lease lost ({lease.lost_reason})"
                if not lost and server.preempt_acked.is_set():
                    # The coordinator takes the slices back after the ack; a signal had no directive.
                    lease.wait_released(timeout=30.0)
                if not requeue(why):
                    return 1
                continue
            lease.release()
            lease = None
            if rc != 0 and server.refused:
                # The script's arguments contradict this launcher's flags: every rerun would stop the same way.
                say(f"the script refused the launcher's spec; not restarted (exit {EXIT_USAGE}): {server.refused}")
                _record_result(endpoints, prefix, security, JobResult(
                    job=spec.name, state="FAILED", exit_code=EXIT_USAGE,
                    reason=f"the script refused the launcher's spec: {server.refused}",
                    attempts=crashes + 1, finished_at=time.time()), retention_s, say)
                return EXIT_USAGE
            if rc == 0:
                say("finished with exit code 0")
                with contextlib.suppress(Exception):
                    _clear_result(endpoints, prefix, security, spec.name)
                return 0
            crashes += 1
            if crashes > max_restarts:
                say(f"failed: {describe_exit(rc)}; --max-restarts {max_restarts} spent")
                _record_result(endpoints, prefix, security, JobResult(
                    job=spec.name, state="FAILED", exit_code=shell_code(rc),
                    reason=f"{describe_exit(rc)} after {crashes} attempts (--max-restarts {max_restarts})",
                    attempts=crashes, finished_at=time.time()), retention_s, say)
                return shell_code(rc)
            delay = min(60.0, backoff_s * 2 ** (crashes - 1))
            say(f"crashed ({describe_exit(rc)}); restart {crashes}/{max_restarts} in {delay:.0f}s from the newest checkpoint")
            time.sleep(delay)
    except _StopWaiting as stop:
        say(f"{signal.Signals(stop.signum).name} while no script ran (queued or between runs): nothing to "
            f"checkpoint; exit {EX_TEMPFAIL} (run again to queue again)")
        return EX_TEMPFAIL
    finally:
        if proc is not None:
            _stop_child(proc, grace_s)
        if lease is not None:
            # Best effort; the client's helper process revokes the lease on exit anyway.
            with contextlib.suppress(Exception):
                lease.release()
        close = getattr(client, "close", None)
        if close is not None:
            close()
        if is_main:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        try:
            for f in os.listdir(sockdir):
                os.unlink(os.path.join(sockdir, f))
            os.rmdir(sockdir)
        except OSError:
            pass


class _StopWaiting(Exception):  # noqa: N818 - control flow, not an error
    """A stop signal arrived while no script ran (the launcher was queued)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _lease_for(client: Any, spec: JobSpec, lease: Any, timeout: float | None, node_rank: int | None, say: Any) -> Any:
    """``lease`` when the launcher still holds one (after a resize), else a new one: acquired, or joined for a gang."""
    if lease is not None:
        return lease
    if not spec.is_gang and spec.node is None:
        client.local_node()  # which node this machine is: a ConfigError here comes before "queueing"
    say(f"queueing {spec.name}: {spec.describe()}")
    on_status = lambda st: say(f"{st.state.value}: {st.reason}")  # noqa: E731
    if spec.is_gang:
        return _join_gang(client, spec, _node_rank(node_rank), timeout, on_status, say)
    return client.acquire(spec, timeout=timeout, on_status=on_status)


def _join_gang(client: Any, spec: JobSpec, node_rank: int, timeout: float | None, on_status: Any,
               say: Any) -> Any:
    """Join the gang; a gang that breaks while this node waits (another node still leaving its last
    run, node rank 0 re-joining) is joined again, within ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else max(1.0, deadline - time.monotonic())
        try:
            return client.join(spec, node_rank=node_rank, nnodes=spec.nodes, timeout=left, on_status=on_status)
        except LeaseLostError as exc:
            if deadline is not None and time.monotonic() >= deadline:
                raise
            say(f"the gang broke while this node waited ({exc}); joining again")
            time.sleep(1.0)


def _node_rank(flag: int | None) -> int:
    """``--node-rank``, else the launcher's environment (Slurm, torchrun, Kubeflow, ``NODE_RANK``)."""
    if flag is not None:
        return flag
    for var in ("SLURM_NODEID", "GROUP_RANK", "PET_NODE_RANK", "NODE_RANK"):
        v = os.environ.get(var, "").strip()
        if v.isdigit():
            return int(v)
    raise ConfigError("--node-rank", "a --nodes gang needs this node's rank: pass --node-rank N, or run under "
                      "srun (SLURM_NODEID) or a launcher that sets NODE_RANK")


def _regranted_since(acked_at: float) -> Any:
    """Predicate: the job is GRANTED again by a grant made after the resize ack, or SUSPENDED (a
    preemption superseded the resize and took the slices back at its ack), or the lease is lost."""

    def check(lease: Any) -> bool:
        st = lease.status
        if lease.lost:
            return True
        if st is not None and st.state is JobState.SUSPENDED:
            return True
        return bool(st is not None and st.state is JobState.GRANTED
                    and (st.granted_at or 0.0) >= acked_at - 1.0 and lease.allocations)

    return check


def _wait(proc: subprocess.Popen[Any], stop_signal: list[int], grace_s: float) -> int:
    """Wait for the script; once a signal was forwarded, give it ``grace_s`` then SIGKILL its group."""
    deadline: float | None = None
    while True:
        try:
            return int(proc.wait(timeout=0.2))
        except subprocess.TimeoutExpired:
            pass
        if stop_signal and deadline is None:
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            return _stop_child(proc, 0.0, signal.SIGKILL)


def _clear_result(endpoints: str | None, prefix: str | None, security: EtcdSecurity | None, job: str) -> None:
    """A finished run removes an earlier FAILED result of the same name."""
    from gpupool_sdk.store import EtcdStore
    from gpupool_sdk.store.keyspace import Keyspace

    store = EtcdStore(endpoints, keyspace=Keyspace.from_env(prefix), security=security)
    try:
        store.delete(store.keys.result(job))
    finally:
        store.close()


def _record_result(endpoints: str | None, prefix: str | None, security: EtcdSecurity | None, result: JobResult,
                   retention_s: float, say: Any) -> None:
    """Leave ``results/{job}`` for ``gpupool status`` on a lease of ``retention_s``; best effort."""
    from gpupool_sdk.store import EtcdStore
    from gpupool_sdk.store.keyspace import Keyspace

    try:
        store = EtcdStore(endpoints, keyspace=Keyspace.from_env(prefix), security=security)
        try:
            lease = store.grant_lease(retention_s)
            store.put(store.keys.result(result.job), result, lease=lease)
        finally:
            store.close()
    except Exception as exc:  # noqa: BLE001 - the exit code still tells
        say(f"could not record the result in etcd ({exc})")
