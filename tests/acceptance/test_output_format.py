"""cli/output.py in isolation: plain tables, wide columns, headers, terminal tables, documents."""

from __future__ import annotations

import io
import json

import pytest
import yaml
from rich.console import Console

from gpupool_sdk.cli.output import TableSpec, emit_document, plain_table, print_sections

T = TableSpec(["JOB", "STATE", "OWNER"], [["bert", "GRANTED", "nlp"], ["a-much-longer-name", "PENDING", "cv"]], "Jobs",
              wide=frozenset({"OWNER"}))


def test_plain_table_aligns_columns_with_spaces() -> None:
    lines = plain_table(T.narrowed(wide=True)).splitlines()
    assert lines[0].index("STATE") == lines[1].index("GRANTED") == lines[2].index("PENDING")
    assert lines[0].index("OWNER") == lines[1].index("nlp")
    assert all(line == line.rstrip() for line in lines)


def test_wide_only_columns_and_no_headers(capsys: pytest.CaptureFixture[str]) -> None:
    print_sections(["leader x", T], wide=False)
    out = capsys.readouterr().out
    assert "OWNER" not in out and "nlp" not in out and out.splitlines()[:2] == ["leader x", "Jobs"]
    print_sections([T], wide=True, no_headers=True)
    out = capsys.readouterr().out
    assert "JOB" not in out and "Jobs" not in out and "nlp" in out


def test_terminal_tables_have_borders_and_plain_ones_do_not(capsys: pytest.CaptureFixture[str]) -> None:
    buf = io.StringIO()
    print_sections([T], console=Console(file=buf, force_terminal=True, width=120))
    assert any("\u2500" <= ch <= "\u257f" for ch in buf.getvalue())
    print_sections([T])
    assert not any("\u2500" <= ch <= "\u257f" for ch in capsys.readouterr().out)


def test_documents_json_lines_and_yaml_stream(capsys: pytest.CaptureFixture[str]) -> None:
    doc = {"jobs": [{"name": "bert", "gpus": 2}], "leader": None}
    emit_document(doc, "json", watching=True)
    emit_document(doc, "json", watching=True)
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == [doc, doc]
    emit_document(doc, "json")
    assert json.loads(capsys.readouterr().out) == doc
    emit_document(doc, "yaml", watching=True)
    emit_document(doc, "yaml", watching=True)
    assert list(yaml.safe_load_all(capsys.readouterr().out)) == [doc, doc]
    with pytest.raises(ValueError):
        emit_document(doc, "table")
