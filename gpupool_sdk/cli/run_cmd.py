"""``gpupool run [spec options] -- python train.py ...``: queue, run on the grant, re-run after preemption.

**Decision:** the launcher holds the job's lease and the script attaches to it over a local
Unix socket (``$GPUPOOL_RUN_SOCKET``; see :mod:`gpupool_sdk.runtime.run_channel`), so the
script's ``GpuPoolCallback``/``PoolSession`` never submits a second spec. After the script exits
with 75 (preempted, checkpointed) or the lease is lost, the launcher releases what is left,
queues again under the same job name and re-runs the script, which resumes from the job's last
acknowledged checkpoint (``$GPUPOOL_RESUME_FROM``). Ctrl-C stops the script and releases everything.

Exit code: the script's own (0 when it finished), 1 after ``--max-restarts`` preemptions,
130 on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from gpupool_sdk.cli.common import endpoints_option, etcd_security_options, prefix_option
from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import JobSpec
from gpupool_sdk.runtime.runtime import (
    CKPT_DIR_ENV,
    DEVICES_ENV,
    EX_TEMPFAIL,
    JOB_ENV,
    LEASED_ENV,
    RESUME_ENV,
    RUN_SOCKET_ENV,
    _visible_devices,
    derive_job_name,
)
from gpupool_sdk.store.security import EtcdSecurity


def _script_of(command: tuple[str, ...]) -> str:
    for arg in command:
        if arg.endswith(".py"):
            return arg
    return command[0]


def _stop_child(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@click.command(
    "run",
    context_settings={"ignore_unknown_options": False, "allow_interspersed_args": False},
)
@click.option("--name", default=None, help="Job name (default: $GPUPOOL_JOB or the script's file name).")
@click.option("--gpus", type=int, default=1, show_default=True, help="Slices wanted.")
@click.option("--memory", default=None, help="Memory per slice, e.g. 20GiB (required unless --qos exclusive).")
@click.option("--qos", type=click.Choice(["shared", "guaranteed", "exclusive"]), default="shared", show_default=True)
@click.option("--priority", type=int, default=0, show_default=True)
@click.option("--compute-share", type=float, default=1.0, show_default=True)
@click.option("--feature", "features", multiple=True, help="Required GPU feature (repeatable): bf16, fp8, nvlink...")
@click.option("--gpu-model", default=None, help="Restrict to one catalog model, e.g. H100-80GB.")
@click.option("--checkpoint-dir", default=None, help="Checkpoint directory passed to the script ($GPUPOOL_CHECKPOINT_DIR).")
@click.option("--acquire-timeout", type=float, default=None, help="Seconds to wait in the queue per attempt.")
@click.option("--max-restarts", type=int, default=100, show_default=True, help="Give up after this many preemptions.")
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
    compute_share: float,
    features: tuple[str, ...],
    gpu_model: str | None,
    checkpoint_dir: str | None,
    acquire_timeout: float | None,
    max_restarts: int,
    endpoints: str | None,
    security: EtcdSecurity,
    prefix: str | None,
    command: tuple[str, ...],
) -> None:
    """Queue a job, run COMMAND on the granted GPUs, and run it again after each preemption.

    Example: gpupool run --memory 20GiB --priority 5 -- python examples/lightning_train.py --epochs 3
    """
    if memory is None and qos != "exclusive":
        raise ConfigError("--memory", f"{qos} jobs must say how much memory per slice they need, e.g. --memory 20GiB")
    if max_restarts < 0:
        raise ConfigError("--max-restarts", f"must be >= 0, got {max_restarts}")
    if acquire_timeout is not None and not (math.isfinite(acquire_timeout) and acquire_timeout > 0):
        raise ConfigError(
            "--acquire-timeout", f"must be a positive number of seconds, got {acquire_timeout}; omit it to wait indefinitely"
        )
    job = derive_job_name(name, argv0=_script_of(command))
    spec = JobSpec(
        name=job,
        gpus=gpus,
        memory=memory or 0,
        qos=qos,
        priority=priority,
        compute_share=compute_share,
        features=tuple(features),
        gpu_model=gpu_model,
    )
    sys.exit(run_job(spec, list(command), endpoints=endpoints, prefix=prefix, checkpoint_dir=checkpoint_dir,
                     acquire_timeout=acquire_timeout, max_restarts=max_restarts, security=security))


def run_job(
    spec: JobSpec,
    command: list[str],
    endpoints: str | None = None,
    prefix: str | None = None,
    checkpoint_dir: str | None = None,
    acquire_timeout: float | None = None,
    max_restarts: int = 100,
    echo: Any = None,
    security: EtcdSecurity | None = None,
) -> int:
    """The loop behind ``gpupool run``: acquire, run, re-queue on exit 75 or lease loss.

    Returns:
        The exit code for the launcher.
    """
    from gpupool_sdk.client import PoolClient
    from gpupool_sdk.runtime.run_channel import RunChannelServer

    say = echo or (lambda msg: click.echo(f"[gpupool run] {msg}", err=True))
    client = PoolClient(endpoints=endpoints, prefix=prefix, security=security)
    sockdir = tempfile.mkdtemp(prefix="gpupool-run-")
    os.chmod(sockdir, 0o700)
    restarts = 0
    lease: Any = None
    proc: subprocess.Popen[Any] | None = None
    try:
        while True:
            say(f"queueing {spec.name}: {spec.describe()}")
            began = time.monotonic()
            lease = client.acquire(
                spec, timeout=acquire_timeout, on_status=lambda st: say(f"{st.state.value}: {st.reason}")
            )
            ck = client.resume_info(spec.name)
            resume = ck.path if ck is not None and ck.path and Path(ck.path).exists() else None
            devices = _visible_devices(lease)
            say(
                f"granted after {time.monotonic() - began:.1f}s: devices {','.join(devices) or '-'}"
                + (f", resuming from {resume}" if resume else "")
            )
            sock = os.path.join(sockdir, f"run-{restarts}.sock")
            server = RunChannelServer(lease, sock, resume)
            env = dict(os.environ)
            env.update({JOB_ENV: spec.name, RUN_SOCKET_ENV: sock, LEASED_ENV: "1", DEVICES_ENV: str(len(devices) or spec.gpus)})
            if devices:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
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
            proc = subprocess.Popen(command, env=env)
            rc = proc.wait()
            proc = None
            server.close()
            lost = bool(getattr(lease, "lost", False))
            if rc == EX_TEMPFAIL or (rc != 0 and lost):
                why = "preempted" if rc == EX_TEMPFAIL else f"lease lost ({getattr(lease, 'lost_reason', '')})"
                if not lost:
                    lease.wait_released(timeout=30.0)
                lease.release()
                lease = None
                restarts += 1
                if restarts > max_restarts:
                    say(f"{why}; giving up after {max_restarts} restarts")
                    return 1
                say(f"{why}; queueing again (restart {restarts})")
                continue
            lease.release()
            lease = None
            say(f"finished with exit code {rc}")
            return rc
    except KeyboardInterrupt:
        say("interrupted: stopping the script and releasing the lease")
        if proc is not None:
            _stop_child(proc)
        return 130
    finally:
        if proc is not None:
            _stop_child(proc)
        if lease is not None:
            # Best effort; the client's helper process revokes the lease on exit anyway.
            with contextlib.suppress(Exception):
                lease.release()
        close = getattr(client, "close", None)
        if close is not None:
            close()
        try:
            for f in os.listdir(sockdir):
                os.unlink(os.path.join(sockdir, f))
            os.rmdir(sockdir)
        except OSError:
            pass
