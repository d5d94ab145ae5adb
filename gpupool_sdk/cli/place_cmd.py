"""``gpupool place``: which nodes could take a shape now (for Slurm / Kubernetes wrappers).

Reads the pool at one etcd revision and runs the scheduler's own placement code on it
(:func:`~gpupool_sdk.scheduler.place_query.query_placement`): nothing is submitted, nothing is
held, so the answer is a hint that another job may overtake a moment later.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from gpupool_sdk.cli.common import (
    EXIT_FAILED,
    echo_json,
    endpoints_option,
    etcd_security_options,
    output_option,
    prefix_option,
    unreachable,
)
from gpupool_sdk.cli.status_cmd import open_store, read_pool
from gpupool_sdk.errors import SpecError, StoreUnavailableError
from gpupool_sdk.resources import JobSpec
from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER
from gpupool_sdk.scheduler.place_query import PlacementAnswer, query_placement
from gpupool_sdk.store.security import EtcdSecurity


def answer_dict(answer: PlacementAnswer, spec: JobSpec) -> dict[str, Any]:
    """The JSON document of ``gpupool place -o json``."""
    return {
        "shape": {
            "nodes": spec.nodes,
            "gpus_per_node": spec.gpus_per_node,
            "memory_bytes": spec.memory_bytes,
            "compute_share": spec.compute_share,
            "qos": spec.qos_class.value,
            "gpu_model": spec.gpu_model,
            "features": list(spec.features),
        },
        "fits": answer.fits,
        "chosen": list(answer.chosen),
        "ranked": [f.to_dict() for f in answer.ranked],
        "unfit": [f.to_dict() for f in answer.unfit],
        "reason": answer.reason,
        "impossible": answer.impossible,
    }


@click.command("place")
@click.option("--gpus", type=int, default=None, help="Slices in all (like Slurm's --gpus); a multiple of --nodes.")
@click.option("--gpus-per-node", type=int, default=None, help="Slices on each node (instead of --gpus).")
@click.option("--nodes", type=int, default=1, show_default=True, help="Nodes the job spans (one part per node).")
@click.option("--memory", default="0", show_default=True, help="Memory per slice ('40GiB'); 0 with exclusive = whole GPU.")
@click.option("--qos", type=click.Choice(["exclusive", "guaranteed", "shared"]), default="guaranteed", show_default=True)
@click.option("--compute-share", type=float, default=1.0, show_default=True, help="Compute share per slice, in (0, 1].")
@click.option("--gpu-model", default=None, help="Only this model (catalog name, e.g. H100-80GB).")
@click.option("--feature", "features", multiple=True, help="A feature every GPU must offer (repeatable: bf16, nvlink...).")
@click.option("--node", default=None, help="Ask about this node only.")
@endpoints_option
@etcd_security_options
@prefix_option
@output_option
def place(
    gpus: int | None,
    gpus_per_node: int | None,
    nodes: int,
    memory: str,
    qos: str,
    compute_share: float,
    gpu_model: str | None,
    features: tuple[str, ...],
    node: str | None,
    endpoints: str | None,
    security: EtcdSecurity,
    prefix: str | None,
    output: str,
) -> None:
    """Which nodes could take a job of this shape now, best fit first (or why none can).

    Nothing is submitted: a launcher asks, picks nodes, then starts the job there (each node's
    process leases its own part). Uses the scheduler's own placement code on the current pool.

    \b
    Examples:
      gpupool place --gpus 8 --memory 40GiB                 # one node with 8 x 40GiB free
      gpupool place --gpus 16 --nodes 2 --memory 40GiB -o json
      gpupool place --gpus-per-node 8 --nodes 2 --qos exclusive
      sbatch -w "$(gpupool place --gpus 16 --nodes 2 -o json | jq -r '.chosen|join(\\",\\")')" job.sh

    \b
    Exit codes: 0 it fits now (the chosen nodes are printed), 1 it does not (the reason is
                printed), 2 bad usage, 3 etcd unreachable.
    """
    if (gpus is None) == (gpus_per_node is None):
        raise click.UsageError("give exactly one of --gpus (in all) and --gpus-per-node")
    if nodes < 1:
        raise click.BadParameter(f"must be >= 1, got {nodes}", param_hint="--nodes")
    if node is not None and nodes > 1:
        raise click.UsageError("--node asks about one node; leave it out with --nodes > 1")
    total = gpus if gpus is not None else (gpus_per_node or 0) * nodes
    try:
        spec = JobSpec(
            name="place-query",
            gpus=total,
            memory=memory,
            qos=qos,
            compute_share=compute_share,
            gpu_model=gpu_model,
            features=features,
            nodes=nodes,
            node=node,
        )
    except SpecError as exc:
        flag = {"gpus": "--gpus", "memory": "--memory", "compute_share": "--compute-share", "node": "--node"}.get(
            exc.field.split(".")[0], f"--{exc.field.replace('_', '-')}"
        )
        raise click.BadParameter(str(exc), param_hint=flag) from None
    logging.getLogger("gpupool_sdk.coordinator.snapshot").setLevel(logging.ERROR)
    store = open_store(endpoints, prefix, security=security)
    try:
        state = read_pool(store)
    except StoreUnavailableError as exc:
        unreachable(endpoints, exc)
    finally:
        store.close()
    answer = query_placement(state.snapshot, spec, DEFAULT_SCHEDULER)
    if output == "json":
        echo_json(answer_dict(answer, spec))
    else:
        head = f"{spec.nodes} node(s) x {spec.gpus_per_node} x [{spec.describe().split('[', 1)[1]}"
        click.echo(f"shape: {head}")
        if answer.fits:
            click.echo(f"fits now on: {', '.join(answer.chosen)}")
        else:
            click.echo(f"does not fit now: {answer.reason}")
        for f in answer.ranked:
            click.echo(f"  {f.node:<20} room ({f.slots} slot(s) for this shape)")
        for f in answer.unfit:
            click.echo(f"  {f.node:<20} no room: {f.reason}")
    if not answer.fits:
        sys.exit(EXIT_FAILED)
