"""The trace loader accepts any file in the unified schema and names row and column on bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpupool_sdk.sim.trace import TraceError, load_trace

HEADER = "job_id,source,submit_s,start_s,end_s,duration_s,num_gpu,gpu_fraction,priority,status,extra\n"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "never_seen.csv"
    p.write_text(text)
    return p


def test_accepts_a_never_seen_file_in_the_schema(tmp_path: Path) -> None:
    # Columns in another order, extra keys it never saw, a CPU-only row, a censored row,
    # a row with only start/end, a row with only an application, and a row with only its arrival.
    text = (
        "extra,status,priority,gpu_fraction,num_gpu,duration_s,end_s,start_s,submit_s,source,job_id\n"
        "foo=1;bar=,Succeeded,LS,0.5,1,120,,,100,mine,r1\n"
        ",,,,0,60,,,5,mine,cpu-only\n"
        ",Running,BE,1.0,2,500,,,50,mine,still-running\n"
        ",,,1.0,1,,300,200,70,mine,from-start-end\n"
        "application=bert,,,1.0,4,,,,80,mine,app\n"
        ",,,1.0,1,,,,90,mine,arrival-only\n"
    )
    trace = load_trace(_write(tmp_path, text), duration_samples=[42.0])
    by_id = {j.job_id: j for j in trace.jobs}
    assert [j.job_id for j in trace.jobs] == ["still-running", "from-start-end", "app", "arrival-only", "r1"]
    assert trace.jobs[0].submit_s == 0.0  # arrivals are relative to the first GPU job
    assert by_id["r1"].gpu_fraction == 0.5 and by_id["r1"].extra == {"foo": "1", "bar": ""}
    assert by_id["still-running"].censored and by_id["still-running"].duration_s == 500.0
    assert by_id["from-start-end"].duration_s == 100.0
    assert by_id["app"].duration_origin == "application" and by_id["app"].duration_s == 2.0 * 3600 / 4
    assert by_id["arrival-only"].duration_origin == "sampled" and by_id["arrival-only"].duration_s == 42.0
    s = trace.stats
    assert (s.rows, s.jobs, s.skipped_cpu_only, s.censored, s.durations_sampled) == (6, 5, 1, 1, 1)


def test_minimal_columns_are_enough(tmp_path: Path) -> None:
    trace = load_trace(_write(tmp_path, "job_id,submit_s,num_gpu,duration_s\na,0,1,10\n"))
    assert trace.jobs[0].gpu_fraction == 1.0 and trace.jobs[0].duration_s == 10.0


def test_censored_rows_can_be_dropped_and_time_compressed(tmp_path: Path) -> None:
    text = HEADER + "a,s,0,,,10,1,1.0,,Running,\nb,s,1000,,,10,1,1.0,,Succeeded,\n"
    trace = load_trace(_write(tmp_path, text), censored="drop", time_scale=0.01)
    assert [j.job_id for j in trace.jobs] == ["b"]
    assert trace.stats.dropped_censored == 1
    trace = load_trace(_write(tmp_path, text), time_scale=0.01)
    assert trace.jobs[1].submit_s == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("row", "column", "hint"),
    [
        ("a,s,soon,,,10,1,1.0,,,", "submit_s", "not a number"),
        ("a,s,0,,,10,1.5,1.0,,,", "num_gpu", "whole number"),
        ("a,s,0,,,10,-1,1.0,,,", "num_gpu", ">= 0"),
        ("a,s,0,,,10,1,1.7,,,", "gpu_fraction", "(0, 1]"),
        ("a,s,0,,,10,2,0.5,,,", "gpu_fraction", "single-GPU"),
        ("a,s,0,,,-5,1,1.0,,,", "duration_s", ">= 0"),
        ("a,s,0,20,10,,1,1.0,,,", "end_s", "before it starts"),
        ("a,s,0,,,10,1,1.0,,,novalue", "extra", "key=value"),
        (",s,0,,,10,1,1.0,,,", "job_id", "empty"),
        ("a,s,0,,,,1,1.0,,,application=chess", "extra", "application"),
    ],
)
def test_malformed_rows_name_row_and_column(tmp_path: Path, row: str, column: str, hint: str) -> None:
    text = HEADER + "ok,s,0,,,10,1,1.0,,,\n" + row + "\n"
    with pytest.raises(TraceError) as info:
        load_trace(_write(tmp_path, text))
    msg = str(info.value)
    assert "row 3" in msg and f"column {column!r}" in msg and hint in msg


def test_duplicate_ids_and_missing_columns_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"row 3, column 'job_id'.*repeats row 2"):
        load_trace(_write(tmp_path, HEADER + "a,s,0,,,10,1,1.0,,,\na,s,1,,,10,1,1.0,,,\n"))
    with pytest.raises(TraceError, match=r"row 1 \(header\): missing column\(s\) \['num_gpu'\]"):
        load_trace(_write(tmp_path, "job_id,submit_s\na,0\n"))
    with pytest.raises(TraceError, match="no file"):
        load_trace(tmp_path / "absent.csv")


def test_source_patterns_match_whole_names(tmp_path: Path) -> None:
    text = HEADER + "a,w-1,0,,,10,1,1.0,,,\nb,w-10,0,,,10,1,1.0,,,\nc,v-1,0,,,10,1,1.0,,,\n"
    path = _write(tmp_path, text)
    assert [j.job_id for j in load_trace(path, sources=["w-1"]).jobs] == ["a"]
    assert [j.job_id for j in load_trace(path, sources=["w-*"]).jobs] == ["a", "b"]


def test_adaptive_application_rows_are_elastic_above_their_ask(tmp_path: Path) -> None:
    # Pollux/Sia applications adapt their GPU count: a row naming one may grow to 4x its ask,
    # never below it; a row's own bounds win; other rows and adaptive_applications=False stay rigid.
    text = (
        "job_id,submit_s,num_gpu,extra\n"
        "app,0,3,application=cifar10\n"
        "own,1,3,application=bert;min_gpu=2;max_gpu=5\n"
        "plain,2,3,\n"
        "small,3,2,application=ncf;batch_size=256\n"
    )
    trace = load_trace(_write(tmp_path, text), duration_samples=[42.0])
    by_id = {j.job_id: j for j in trace.jobs}
    assert (by_id["app"].min_gpu, by_id["app"].max_gpu) == (None, 12) and by_id["app"].is_elastic
    assert (by_id["own"].min_gpu, by_id["own"].max_gpu) == (2, 5)
    assert not by_id["plain"].is_elastic
    assert by_id["small"].max_gpu == 8
    assert trace.stats.elastic == 3
    rigid = load_trace(_write(tmp_path, text), duration_samples=[42.0], adaptive_applications=False)
    assert [j.is_elastic for j in rigid.jobs] == [False, True, False, False]
    assert rigid.stats.elastic == 1


def test_a_spreadsheet_file_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    # Saved by a spreadsheet: UTF-8 byte-order mark and CRLF line ends; the first column is
    # still job_id (not '\ufeffjob_id', which made the header look as if job_id were missing).
    p = tmp_path / "excel.csv"
    p.write_bytes(b"\xef\xbb\xbf" + HEADER.replace("\n", "\r\n").encode() + b"a,s,0,,,100,1,,,,\r\n")
    trace = load_trace(p)
    assert [j.job_id for j in trace.jobs] == ["a"] and trace.jobs[0].duration_s == 100.0


def test_a_fractional_num_gpu_says_how_to_write_a_share(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"row 2, column 'num_gpu'.*num_gpu=1 and gpu_fraction=0.5"):
        load_trace(_write(tmp_path, HEADER + "a,s,0,,,100,0.5,,,,\n"))
    with pytest.raises(TraceError, match=r"row 2, column 'num_gpu': must be a whole number of GPUs, got '1.5'$"):
        load_trace(_write(tmp_path, HEADER + "a,s,0,,,100,1.5,,,,\n"))
