"""``gpupool simulate``: replay a trace against the pool's scheduler and the baselines."""

from __future__ import annotations

import click

from gpupool_sdk.cli.common import echo_json, output_option


@click.command("simulate")
@click.option("--trace", "trace_path", required=True, metavar="FILE",
              help="CSV in the unified trace schema (a bare name is looked up in ../shared/traces).")
@click.option("--cluster", required=True, metavar="SPEC",
              help="Cluster in the agent's --simulate format; 'N*' repeats a node: '16*8xV100-32GB:nvlink'.")
@click.option("--policy", "policies", multiple=True, default=("fifo", "tiresias", "gpupool"), show_default=True,
              type=click.Choice(["fifo", "tiresias", "gpupool", "bestfit", "gandiva"]), help="Policy to run (repeat for several).")
@output_option
@click.option("--plot", "plot_path", default=None, metavar="FILE.png", help="Write the JCT CDF and utilization plot.")
@click.option("--seed", default=0, show_default=True, help="Seeds duration draws, profiles and failures.")
@click.option("--max-jobs", default=None, type=int, help="Keep only the first N GPU jobs by arrival.")
@click.option("--time-scale", default=1.0, show_default=True, type=float,
              help="Multiply arrival times (0.01 = arrivals 100x denser); durations are kept.")
@click.option("--source", "sources", multiple=True, help="Keep rows whose source matches this pattern ('sia_saturn_*'; repeatable).")
@click.option("--max-duration", default=None, type=float, metavar="SECONDS",
              help="Clip run times (counted as censored).")
@click.option("--censored", default="keep", show_default=True, type=click.Choice(["keep", "drop"]),
              help="Rows still running at trace end: keep their observed run time, or drop them.")
@click.option("--checkpoint-s", default=10.0, show_default=True, help="Preempt directive to ack (checkpoint write).")
@click.option("--restart-s", default=20.0, show_default=True, help="Extra work after a preemption (restart).")
@click.option("--failure-mtbf-h", default=None, type=float, help="Per-GPU mean time between failures (hours).")
@click.option("--config", "config_path", default=None, metavar="FILE.toml",
              help="gpupool: the policy file `gpupool coordinator --config` reads (default: the built-in defaults, "
                   "docs/scheduler.md 'Policy file'); the flags below override single fields.")
@click.option("--set", "assignments", multiple=True, metavar="FIELD=VALUE",
              help="gpupool: set one scheduler field, TOML value (use_remaining=false, min_runtime_s=600); repeatable.")
@click.option("--overcommit", default=None, type=float, help="gpupool: shared-class memory overcommit ratio (default 1.5).")
@click.option("--untagged-qos", default="guaranteed", show_default=True,
              type=click.Choice(["guaranteed", "shared", "exclusive"]), help="gpupool: QoS of rows without a class.")
@click.option("--class-priority", default="", metavar="CLASS=INT[,...]",
              help="gpupool: queue priority per trace class, e.g. 'Guaranteed=20,LS=10,Burstable=5,BE=0' "
                   "(default: every class priority 0; the class then only chooses the QoS).")
@click.option("--las", "las", default=None, metavar="GPU_S[,GPU_S...]",
              help="gpupool: least-attained-service queue thresholds (GPU-seconds; default: the policy's, "
                   "1800,18000,180000); '' = off.")
@click.option("--las-promote-factor", default=None, type=float, metavar="F",
              help="gpupool, with LAS: a job that waited F x its run so far counts as queue 0 again "
                   "(starvation promotion; 0 = off).")
@click.option("--las-no-preempt", is_flag=True, default=False,
              help="gpupool, with LAS: LAS only orders pending jobs and never preempts for them.")
@click.option("--min-runtime-s", default=None, type=float, help="gpupool: minimum run time before preemption (default 0).")
@click.option("--aging-s", default=None, type=float,
              help="gpupool: seconds of waiting per priority point (default 0 = no aging; use with --min-runtime-s).")
@click.option("--estimate-after-s", default=300.0, show_default=True, type=float, metavar="S",
              help="Workload model: a job reports its remaining time once it has run this long in all.")
@click.option("--undeclared", default=0.25, show_default=True, type=float, metavar="FRACTION",
              help="Workload model: fraction of jobs that declare no length (never report remaining time).")
@click.option("--early-stop", default="0.2,0.3", show_default=True, metavar="FRACTION[,MIN]",
              help="Workload model: FRACTION of declaring jobs stop early, at a uniform draw in [MIN, 1) of their "
                   "declared length (their estimate is too long).")
@click.option("--estimate-sigma", default=0.2, show_default=True, type=float, metavar="SIGMA",
              help="Workload model: per-job lognormal error of the measured step time.")
@click.option("--no-estimates", is_flag=True, default=False,
              help="Workload model: no job reports its remaining time (a pool without progress telemetry).")
@click.option("--elastic", "elastic", default="", metavar="MIN_FRACTION[,MAX_FACTOR]",
              help="gpupool only: every job asking n GPUs (without its own min_gpu=/max_gpu= in extra, and not an "
                   "adaptive application row unless --rigid-applications) may run on ceil(n*MIN_FRACTION) to "
                   "floor(n*MAX_FACTOR) GPUs, e.g. 0.5,2; baselines keep n.")
@click.option("--rigid-applications", is_flag=True, default=False,
              help="Workload: rows of the adaptive Pollux/Sia applications (application= in extra) run on the "
                   "GPUs they ask, rigid (default: they may grow to 4x that under gpupool, as in Pollux and Sia).")
@click.option("--application-hours", "application_hours", multiple=True, metavar="NAME=GPU_HOURS",
              help="Workload: GPU-hours of an application= that rows name without duration_s (adds to or replaces "
                   "the built-in table of Pollux/Sia applications; repeatable). Such a new application is rigid.")
@click.option("--elastic-sigma", default=0.05, show_default=True, type=float, metavar="SIGMA",
              help="Serial fraction of the elastic speed-up: throughput(k) = k / (1 + SIGMA*(k-1)), "
                   "normalised to the GPUs the trace asked for (0 = linear).")
@click.option("--max-pending", default=None, type=int, metavar="N",
              help="gpupool speed knob: show the scheduler only the first N pending jobs (default: all).")
@click.option("--gandiva-quantum-s", default=60.0, show_default=True, type=float, metavar="S",
              help="gandiva: time slice; jobs are suspended and resumed round-robin when GPUs are oversubscribed.")
@click.option("--gandiva-suspend-s", default=0.5, show_default=True, type=float, metavar="S",
              help="gandiva: suspend cost (directive to freed GPUs).")
@click.option("--gandiva-resume-s", default=0.5, show_default=True, type=float, metavar="S",
              help="gandiva: resume cost (extra work at the next grant).")
def simulate(
    trace_path: str,
    cluster: str,
    policies: tuple[str, ...],
    output: str,
    plot_path: str | None,
    seed: int,
    max_jobs: int | None,
    time_scale: float,
    sources: tuple[str, ...],
    max_duration: float | None,
    censored: str,
    checkpoint_s: float,
    restart_s: float,
    failure_mtbf_h: float | None,
    config_path: str | None,
    assignments: tuple[str, ...],
    overcommit: float | None,
    untagged_qos: str,
    class_priority: str,
    las: str | None,
    las_promote_factor: float | None,
    las_no_preempt: bool,
    min_runtime_s: float | None,
    aging_s: float | None,
    estimate_after_s: float,
    undeclared: float,
    early_stop: str,
    estimate_sigma: float,
    no_estimates: bool,
    elastic: str,
    rigid_applications: bool,
    application_hours: tuple[str, ...],
    elastic_sigma: float,
    max_pending: int | None,
    gandiva_quantum_s: float,
    gandiva_suspend_s: float,
    gandiva_resume_s: float,
) -> None:
    """Simulate a trace on a cluster under several policies and compare them to FIFO.

    ``gpupool`` runs the pool's policy configuration (the defaults, or --config FILE, then the
    flags); the configuration is printed with the results.

    Example: gpupool simulate --trace tiresias_60job.csv --cluster "2*8xV100-32GB" --policy fifo --policy gpupool
    """
    import importlib.util
    import math
    from dataclasses import asdict

    if plot_path and importlib.util.find_spec("matplotlib") is None:
        # Checked before the simulation runs (minutes on a large trace), not when the plot is drawn.
        raise click.BadParameter(
            "needs matplotlib, which is not installed: pip install 'gpupool-sdk[plot]' (or drop --plot)",
            param_hint="--plot",
        )

    from gpupool_sdk.errors import ConfigError
    from gpupool_sdk.scheduler.config import load_policy_config, parse_assignment
    from gpupool_sdk.sim.engine import SimConfig
    from gpupool_sdk.sim.estimates import EstimateModel
    from gpupool_sdk.sim.pool_policy import PoolMapping, parse_class_priority, parse_elastic
    from gpupool_sdk.sim.runner import (
        GandivaSettings,
        render_table,
        run_simulation,
        write_plot,
    )
    from gpupool_sdk.sim.trace import load_trace, parse_application_hours

    overrides: dict[str, object] = {}
    flags: dict[str, str] = {}
    for text in assignments:
        key, value = parse_assignment(text)
        overrides[key] = value
        flags[key] = f"--set {key}"
    if las is not None:
        try:
            overrides["las_threshold_gpu_s"] = tuple(float(x) for x in las.split(",") if x.strip())
        except ValueError:
            raise ConfigError("--las", f"{las!r} is not a comma-separated list of GPU-seconds, e.g. 3600,36000") from None
        flags["las_threshold_gpu_s"] = "--las"
    for key, flag, value in (
        ("overcommit_ratio", "--overcommit", overcommit),
        ("las_promote_after_factor", "--las-promote-factor", las_promote_factor),
        ("min_runtime_s", "--min-runtime-s", min_runtime_s),
        ("aging_s_per_priority", "--aging-s", aging_s),
        ("las_preempt", "--las-no-preempt", False if las_no_preempt else None),
    ):
        if value is not None:
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(flag, f"must be a finite number, got {value}")
            overrides[key] = value
            flags[key] = flag
    policy = load_policy_config(config_path, overrides, flags)
    if not policy.scheduler.las_threshold_gpu_s:
        for key, flag in (("las_promote_after_factor", "--las-promote-factor"), ("las_preempt", "--las-no-preempt")):
            if key in overrides:
                raise ConfigError(flag, "acts within LAS queues, which this configuration turns off; give --las GPU_S[,GPU_S...]")
    try:
        stop = [float(x) for x in early_stop.split(",")]
        if not 1 <= len(stop) <= 2:
            raise ValueError(early_stop)
    except ValueError:
        raise ConfigError("--early-stop", f"expected FRACTION[,MIN], e.g. 0.2,0.3, got {early_stop!r}") from None
    try:
        estimates = EstimateModel(
            after_s=estimate_after_s, undeclared=undeclared, early_stop=stop[0],
            early_stop_min=stop[1] if len(stop) == 2 else EstimateModel.early_stop_min, sigma=estimate_sigma,
            enabled=not no_estimates,
        )
    except ConfigError as exc:
        flag = {"after_s": "--estimate-after-s", "undeclared": "--undeclared", "early_stop": "--early-stop",
                "early_stop_min": "--early-stop", "sigma": "--estimate-sigma"}[exc.field]
        raise ConfigError(flag, str(exc).split(": ", 1)[1]) from None
    try:
        class_prio = parse_class_priority(class_priority)
    except ConfigError as exc:
        raise ConfigError("--class-priority", str(exc).split(": ", 1)[1]) from None
    try:
        elastic_bounds = parse_elastic(elastic) if elastic.strip() else None
    except ConfigError as exc:
        raise ConfigError("--elastic", str(exc).split(": ", 1)[1]) from None
    try:
        gandiva = GandivaSettings(quantum_s=gandiva_quantum_s, suspend_s=gandiva_suspend_s, resume_s=gandiva_resume_s)
    except ConfigError as exc:
        flag = "--gandiva-" + exc.field.removesuffix("_s").replace("_", "-") + "-s"
        raise ConfigError(flag, str(exc).split(": ", 1)[1]) from None
    try:
        app_hours = parse_application_hours(application_hours)
    except ConfigError as exc:
        raise ConfigError("--application-hours", str(exc).split(": ", 1)[1]) from None
    trace = load_trace(
        trace_path, seed=seed, max_jobs=max_jobs, time_scale=time_scale, censored=censored, sources=sources,
        max_duration_s=max_duration, adaptive_applications=not rigid_applications, application_gpu_hours=app_hours,
    )
    try:
        sim_config = SimConfig(
            checkpoint_s=checkpoint_s, restart_s=restart_s, failure_mtbf_h=failure_mtbf_h, seed=seed,
            elastic_sigma=elastic_sigma,
        )
    except ConfigError as exc:
        if exc.field != "elastic_sigma":
            raise
        raise ConfigError("--elastic-sigma", str(exc).split(": ", 1)[1]) from None
    pool_config = policy.scheduler
    mapping = PoolMapping(
        untagged_qos=untagged_qos, class_priority=class_prio, preempt_grace_s=max(60.0, 2 * checkpoint_s),
        elastic=elastic_bounds,
    )
    # On a terminal a status line says which policy runs (a congested run takes minutes per policy);
    # piped or with -o json nothing extra is printed.
    from contextlib import ExitStack

    from gpupool_sdk.cli.output import is_terminal

    with ExitStack() as stack:
        on_policy = None
        if output != "json" and is_terminal():
            from rich.console import Console as _Console

            status = stack.enter_context(_Console(stderr=True).status("simulating"))

            def on_policy(name: str, i: int, n: int) -> None:
                status.update(f"simulating {name} ({i + 1}/{n}) on {len(trace)} jobs")

        report = run_simulation(
            trace, cluster, list(policies), sim_config=sim_config, pool_config=pool_config, mapping=mapping, seed=seed,
            max_pending_in_snapshot=max_pending, gandiva=gandiva, estimates=estimates, on_policy=on_policy,
        )
    if plot_path:
        write_plot(report, plot_path)
    if output == "json":
        echo_json({**report.to_json(), "config": policy.to_dict(), "estimates": asdict(estimates)})
        return
    from rich.console import Console

    console = Console()
    if "gpupool" in policies:
        click.echo(policy.describe())
        e = estimates
        click.echo(
            "# workload model: " + ("no job reports its remaining time" if not e.enabled else
            f"remaining time reported after {e.after_s:g} s of run, {e.undeclared:.0%} of jobs declare nothing, "
            f"{e.early_stop:.0%} stop early at [{e.early_stop_min:g}, 1) of their length, step-time error sigma {e.sigma:g}")
        )
    console.print(render_table(report))
    stats = report.trace_stats
    console.print(
        f"trace: {stats['rows']} rows, {stats['jobs']} GPU jobs, {stats['skipped_cpu_only']} CPU-only skipped, "
        f"{stats['censored']} right-censored, {stats['durations_sampled']} durations drawn, "
        f"{stats['durations_from_application']} from the application table, {stats['elastic']} elastic"
    )
    for note in report.notes():
        console.print(f"note: {note}")
    if plot_path:
        console.print(f"plot written to {plot_path}")
