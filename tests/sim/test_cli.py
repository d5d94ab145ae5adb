"""``gpupool simulate``: JSON keys, determinism with a seed, the table and the plot."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from gpupool_sdk.cli.simulate_cmd import simulate

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


def test_table_and_plot(tmp_path: Path) -> None:
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


def test_bad_cluster_is_a_usage_error(tmp_path: Path) -> None:
    trace = tmp_path / "arrivals.csv"
    trace.write_text(ROWS)
    res = CliRunner().invoke(simulate, ["--trace", str(trace), "--cluster", "8xNOPE"])
    assert res.exit_code != 0
    assert "NOPE" in str(res.exception) or "NOPE" in res.output
