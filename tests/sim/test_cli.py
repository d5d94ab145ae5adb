"""``gpupool simulate``: JSON keys, determinism with a seed, the table and the plot, policy flags."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from gpupool_sdk.cli.simulate_cmd import simulate
from gpupool_sdk.errors import ConfigError
from gpupool_sdk.scheduler.types import SchedulerConfig

# Arrivals only: durations are drawn from the Tiresias samples with the seed.
ROWS = "job_id,source,submit_s,num_gpu,gpu_fraction,priority\n" + "".join(
    f"j{i},t,{i * 30},{1 + i % 3},{0.5 if i % 3 == 0 else 1.0},{'BE' if i % 2 else 'LS'}\n" for i in range(24)
)
REQUIRED = {
    "avg_jct_s", "p50_jct_s", "p99_jct_s", "avg_queue_s", "makespan_s", "gpu_alloc_util", "gpu_used_util",
    "mem_util", "preemptions", "stranded_gpu_fraction",
}


def _invoke(tmp_path: Path, *extra: str) -> dict:
    trace = tmp_path / "arrivals.csv"
    trace.write_text(ROWS)
    args = ["--trace", str(trace), "--cluster", "2*4xV100-32GB", "--policy", "fifo", "--policy", "gpupool",
            "--policy", "tiresias", "-o", "json", *extra]
    res = CliRunner().invoke(simulate, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_json_has_the_required_keys(tmp_path: Path) -> None:
    out = _invoke(tmp_path, "--seed", "1")
    assert {"trace", "cluster", "jobs", "policies"} <= set(out)
    assert out["jobs"] == 24 and out["cluster"] == "2*4xV100-32GB"
    assert set(out["policies"]) == {"fifo", "gpupool", "tiresias"}
    for metrics in out["policies"].values():
        assert set(metrics) >= REQUIRED
        assert metrics["finished"] == 24


def test_same_seed_same_result_other_seed_differs(tmp_path: Path) -> None:
    def strip(o: dict) -> dict:
        for m in o["policies"].values():
            m.pop("wall_s")
        return o

    a = strip(_invoke(tmp_path, "--seed", "7"))
    b = strip(_invoke(tmp_path, "--seed", "7"))
    c = strip(_invoke(tmp_path, "--seed", "8"))
    assert a == b
    assert a["policies"]["fifo"]["avg_jct_s"] != c["policies"]["fifo"]["avg_jct_s"]


def _matplotlib_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib from this environment, else from the folder ``scripts/install`` puts it in."""
    if importlib.util.find_spec("matplotlib") is not None:
        return
    site = Path(sys.prefix) / "plot-site"  # see scripts/install: kept off the path of the Lightning tests
    if not (site / "matplotlib").is_dir():
        pytest.skip("matplotlib is not installed: pip install 'gpupool-sdk[plot]' (scripts/install puts it in <venv>/plot-site)")
    monkeypatch.syspath_prepend(str(site))


def test_table_and_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _matplotlib_importable(monkeypatch)
    trace = tmp_path / "arrivals.csv"
    trace.write_text(ROWS)
    png = tmp_path / "out.png"
    res = CliRunner().invoke(
        simulate,
        ["--trace", str(trace), "--cluster", "2*4xV100-32GB", "--policy", "fifo", "--policy", "bestfit", "--plot", str(png)],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert "avg JCT" in res.output and "bestfit" in res.output
    assert png.stat().st_size > 1000


def test_plot_without_matplotlib_is_refused_before_the_simulation_runs(tmp_path: Path) -> None:
    """Without matplotlib: exit 2 naming --plot and the extra, at once (no simulation, no table)."""
    import subprocess

    trace = tmp_path / "arrivals.csv"
    trace.write_text(ROWS)
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # not importable, as where it is not installed
        "from gpupool_sdk.cli.main import main; sys.argv[0] = 'gpupool'; sys.exit(main())"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "simulate", "--trace", str(trace), "--cluster", "2*4xV100-32GB",
         "--policy", "fifo", "--plot", str(tmp_path / "out.png")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--plot" in r.stderr and "gpupool-sdk[plot]" in r.stderr, r.stderr
    assert "avg JCT" not in r.stdout and not (tmp_path / "out.png").exists()


def test_bad_cluster_is_a_usage_error(tmp_path: Path) -> None:
    trace = tmp_path / "arrivals.csv"
    trace.write_text(ROWS)
    res = CliRunner().invoke(simulate, ["--trace", str(trace), "--cluster", "8xNOPE"])
    assert res.exit_code != 0
    assert "NOPE" in str(res.exception) or "NOPE" in res.output


# Two 600 s jobs on one GPU, and a long job preempted by a short one under LAS (1 GPU).
TWO_JOBS = "job_id,source,submit_s,duration_s,num_gpu\na,t,0,600,1\nb,t,0,600,1\n"
LAS_ROWS = "job_id,source,submit_s,duration_s,num_gpu\na,t,0,1000,1\nb,t,200,100,1\n"


def _run_cli(tmp_path: Path, rows: str, *args: str) -> Result:
    trace = tmp_path / "rows.csv"
    trace.write_text(rows)
    return CliRunner().invoke(simulate, ["--trace", str(trace), "--cluster", "1xV100-32GB", *args])


def test_gandiva_runs_with_fifo_and_takes_its_knobs(tmp_path: Path) -> None:
    # Quantum 60 s, suspend 1 s, resume 2 s: a ends at 1240, b at 1260 (see test_gandiva), 20 suspends.
    res = _run_cli(
        tmp_path, TWO_JOBS, "--policy", "fifo", "--policy", "gandiva", "--gandiva-quantum-s", "60",
        "--gandiva-suspend-s", "1", "--gandiva-resume-s", "2", "-o", "json",
    )
    assert res.exit_code == 0, res.output
    policies = json.loads(res.output)["policies"]
    assert list(policies) == ["fifo", "gandiva"]
    assert policies["fifo"]["avg_jct_s"] == 900.0 and policies["fifo"]["preemptions"] == 0
    assert policies["gandiva"]["avg_jct_s"] == 1250.0 and policies["gandiva"]["preemptions"] == 20
    # A quantum longer than the jobs: no time-slicing left, FIFO's schedule.
    res = _run_cli(tmp_path, TWO_JOBS, "--policy", "gandiva", "--gandiva-quantum-s", "600", "-o", "json")
    assert json.loads(res.output)["policies"]["gandiva"]["avg_jct_s"] == 900.0


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--gandiva-quantum-s", "0"], "--gandiva-quantum-s"),
        (["--gandiva-suspend-s", "-1"], "--gandiva-suspend-s"),
        (["--gandiva-resume-s", "inf"], "--gandiva-resume-s"),
        (["--las", "100", "--las-promote-factor", "-1"], "--las-promote-factor"),
        (["--las", "100", "--las-promote-factor", "nan"], "--las-promote-factor"),
        (["--las", "", "--las-promote-factor", "2"], "--las-promote-factor"),  # LAS turned off
        (["--las", "", "--las-no-preempt"], "--las-no-preempt"),
        (["--set", "overcommit=2"], "--set overcommit"),  # unknown field (did you mean overcommit_ratio?)
        (["--set", "use_remaining=1"], "--set use_remaining"),  # not a boolean
        (["--overcommit", "0.5"], "--overcommit"),
        (["--undeclared", "1.5"], "--undeclared"),
        (["--early-stop", "x"], "--early-stop"),
        (["--class-priority", "LS=high"], "--class-priority"),
        (["--application-hours", "gpt2"], "--application-hours"),
        (["--application-hours", "gpt2=-1"], "--application-hours"),
        (["--application-hours", "=3"], "--application-hours"),
    ],
)
def test_bad_flag_values_name_the_flag(tmp_path: Path, args: list[str], flag: str) -> None:
    res = _run_cli(tmp_path, TWO_JOBS, "--policy", "gandiva", "--policy", "gpupool", *args)
    assert res.exit_code != 0
    assert isinstance(res.exception, ConfigError)
    assert res.exception.field == flag


def test_las_no_preempt_keeps_las_to_ordering(tmp_path: Path) -> None:
    # --las 100: b (fresh, queue 0) preempts a (1000 s, queue 1) at 200 unless --las-no-preempt.
    def gpupool(*extra: str) -> dict:
        res = _run_cli(tmp_path, LAS_ROWS, "--policy", "gpupool", "--las", "100", *extra, "-o", "json")
        assert res.exit_code == 0, res.output
        return json.loads(res.output)["policies"]["gpupool"]

    assert gpupool()["preemptions"] == 1
    off = gpupool("--las-no-preempt")
    assert off["preemptions"] == 0
    assert off["avg_jct_s"] == (1000 + (1100 - 200)) / 2


def test_las_flags_reach_the_scheduler_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpupool_sdk.sim import runner

    seen: dict[str, SchedulerConfig] = {}
    real = runner.run_simulation

    def spy(*args: object, **kwargs: Any) -> runner.SimReport:
        seen["config"] = kwargs["pool_config"]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "run_simulation", spy)
    res = _run_cli(tmp_path, LAS_ROWS, "--policy", "gpupool", "--las", "100,1000", "--las-promote-factor", "2.5",
                   "--las-no-preempt", "-o", "json")
    assert res.exit_code == 0, res.output
    cfg = seen["config"]
    assert (cfg.las_threshold_gpu_s, cfg.las_promote_after_factor, cfg.las_preempt) == ((100.0, 1000.0), 2.5, False)
    res = _run_cli(tmp_path, LAS_ROWS, "--policy", "gpupool", "--las", "100", "-o", "json")
    assert res.exit_code == 0, res.output
    assert (seen["config"].las_promote_after_factor, seen["config"].las_preempt) == (0.0, True)


def test_class_priority_lets_ls_preempt_be(tmp_path: Path) -> None:
    # One 32 GiB GPU; x (BE, 20 GiB) runs from 0, y (LS, 20 GiB) arrives at 50. By default the classes
    # are QoS only (both priority 0): y waits for x. With LS ranked above BE, y preempts x.
    rows = "job_id,source,submit_s,start_s,end_s,duration_s,num_gpu,gpu_fraction,priority,status,extra\n" + "x,t,0,,,100,1,1.0,BE,,gpu_mem_gib=20\ny,t,50,,,40,1,1.0,LS,,gpu_mem_gib=20\n"
    path = tmp_path / "pair.csv"
    path.write_text(rows)

    def gpupool(*extra: str) -> dict:
        res = CliRunner().invoke(simulate, ["--trace", str(path), "--cluster", "1xV100-32GB",
                                            "--policy", "gpupool", "-o", "json", *extra])
        assert res.exit_code == 0, res.output
        return json.loads(res.output)["policies"]["gpupool"]

    flat = gpupool()
    assert flat["preemptions"] == 0 and flat["by_class"]["LS"]["avg_queue_s"] == 50.0
    ranked = gpupool("--class-priority", "LS=10,BE=0")
    assert ranked["preemptions"] == 1 and ranked["by_class"]["LS"]["avg_queue_s"] < 50.0


def test_help_states_the_policy_defaults_it_overrides() -> None:
    """Each policy flag's help names the default the pool really runs (DEFAULT_SCHEDULER), not an
    older one (the --las help said 3600,36000 after the ladder moved to 1800,18000,180000)."""
    from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER

    res = CliRunner().invoke(simulate, ["--help"], terminal_width=400)
    text = " ".join(res.output.split())
    ladder = ",".join(f"{t:g}" for t in DEFAULT_SCHEDULER.las_threshold_gpu_s)
    assert f"default: the policy's, {ladder})" in text, text
    assert f"default {DEFAULT_SCHEDULER.overcommit_ratio:g})" in text


def test_an_application_the_table_does_not_know_names_the_flag_that_sizes_it(tmp_path: Path) -> None:
    # A trace never seen, whose rows carry only an application= the built-in table lacks: the
    # error names the row, the column and --application-hours; with the flag it runs, and the
    # job's run time is its GPU-hours over the GPUs it asks (8 GPU-h on 2 GPUs: 4 h).
    rows = "job_id,source,submit_s,num_gpu,extra\na,t,0,2,application=gpt2;batch_size=32\n"
    res = _run_cli(tmp_path, rows, "--policy", "fifo", "-o", "json")
    assert res.exit_code != 0
    assert "row 2" in str(res.exception) and "'extra'" in str(res.exception)
    assert "--application-hours gpt2=GPU_HOURS" in str(res.exception)
    two = "2xV100-32GB"
    trace = tmp_path / "rows.csv"
    res = CliRunner().invoke(
        simulate, ["--trace", str(trace), "--cluster", two, "--policy", "fifo", "--application-hours", "gpt2=8",
                   "-o", "json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["policies"]["fifo"]["avg_jct_s"] == 4 * 3600.0


def test_a_run_without_congestion_says_so(tmp_path: Path) -> None:
    # Two 600 s jobs: on two GPUs nobody waits (every policy ties: a note says why and what to do);
    # on one GPU the second waits 600 s of its 1,200 s under FIFO (no note).
    two = tmp_path / "two.csv"
    two.write_text(TWO_JOBS)

    def run(cluster: str, *extra: str) -> Result:
        return CliRunner().invoke(simulate, ["--trace", str(two), "--cluster", cluster, "--policy", "fifo", *extra])

    idle = run("2xV100-32GB", "-o", "json")
    assert idle.exit_code == 0, idle.output
    (note,) = json.loads(idle.output)["notes"]
    assert note.startswith("not congested") and "--time-scale" in note and "--cluster" in note
    assert "note: not congested" in " ".join(run("2xV100-32GB").output.split())
    busy = run("1xV100-32GB", "-o", "json")
    assert busy.exit_code == 0, busy.output
    assert json.loads(busy.output)["notes"] == []
    assert "not congested" not in run("1xV100-32GB").output
