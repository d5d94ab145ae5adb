"""``gpupool demo``: the whole pool on loopback with small Lightning jobs on the CPU."""

from __future__ import annotations

import sys

import click


@click.command("demo")
@click.option(
    "--simulate",
    default="demo-node:2xA100-40GB:nvlink",
    show_default=True,
    help="Simulated GPUs of the demo's agent (declared, never silent): NODE:NxMODEL[:LINK].",
)
@click.option("--timeout", "timeout_s", type=float, default=110.0, show_default=True, help="Fail after this many seconds.")
@click.option("--workdir", default=None, help="Keep checkpoints and logs here (default: a temporary directory).")
def demo(simulate: str, timeout_s: float, workdir: str | None) -> None:
    """Start etcd, a coordinator, a simulated agent and three small Lightning jobs; show a preemption.

    A low-priority job is preempted by a high-priority one, checkpoints, exits 75, is queued
    again by `gpupool run`, resumes from its checkpoint and finishes. Exit code 0 on success.

    Example: gpupool demo
    """
    if timeout_s <= 0:
        raise click.BadParameter(f"must be > 0 seconds, got {timeout_s}", param_hint="--timeout")
    from gpupool_lightning.demo.orchestrator import run_demo

    sys.exit(run_demo(simulate=simulate, timeout_s=timeout_s, workdir=workdir))
