"""Output of the reading commands, in the manner of kubectl: tables, ``-o wide|json|yaml``, ``-w`` streams.

* ``-o table`` (default): on a terminal, rich tables with borders and titles; anywhere else
  (a pipe, a file) plain columns aligned with spaces, no box drawing, no colour, so that
  ``gpupool status | grep`` and ``awk`` work; a table's title is a line of its own above it.
  ``--no-headers`` drops the header rows and titles.
* ``-o wide``: the same tables with more columns.
* ``-o json``: one indented document; under ``-w``, one compact JSON object per line (a stream
  that ``jq -c`` or a line reader parses line by line).
* ``-o yaml``: one YAML document; under ``-w``, documents separated by ``---``.

Example:
    >>> t = TableSpec(["NAME", "STATE"], [["bert", "GRANTED"], ["gpt", "PENDING"]])
    >>> print(plain_table(t), end="")
    NAME   STATE
    bert   GRANTED
    gpt    PENDING
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import click

from gpupool_sdk.resources.units import format_size

OUTPUT_FORMATS = ("table", "wide", "json", "yaml")

F = TypeVar("F", bound=Callable[..., Any])


#: Columns of a GPU's device readings (:meth:`~gpupool_sdk.resources.GpuHealth.readings`), in :func:`reading_cells` order.
READING_COLUMNS = ("DEV UTIL", "MEM BW", "DEV MEM", "PCIE TX/RX", "NVLINK TX/RX", "TEMP", "POWER")


def reading_cells(readings: Mapping[str, Any]) -> list[str]:
    """The cells of :data:`READING_COLUMNS` for one GPU's readings; ``-`` where unknown.

    Example:
        >>> reading_cells({"utilization": 0.5, "pcie_rx_bytes_per_s": 2 * 1024**3, "power_w": 300.0})
        ['50%', '-', '-', '-/2.0GiB/s', '-', '-', '300W']
    """
    def pct(key: str) -> str:
        v = readings.get(key)
        return "-" if v is None else f"{100 * v:.0f}%"

    def size(v: Any, suffix: str = "") -> str:
        return "-" if v is None else format_size(v) + suffix

    def pair(kind: str) -> str:
        tx, rx = readings.get(f"{kind}_tx_bytes_per_s"), readings.get(f"{kind}_rx_bytes_per_s")
        return "-" if tx is None and rx is None else f"{size(tx, '/s')}/{size(rx, '/s')}"

    def num(key: str, unit: str) -> str:
        v = readings.get(key)
        return "-" if v is None else f"{v:.0f}{unit}"

    return [pct("utilization"), pct("memory_bandwidth_utilization"), size(readings.get("memory_used_bytes")),
            pair("pcie"), pair("nvlink"), num("temperature_c", "C"), num("power_w", "W")]


def output_option(f: F) -> F:
    """``-o/--output table|wide|json|yaml`` (default table)."""
    return click.option(
        "-o", "--output", type=click.Choice(OUTPUT_FORMATS), default="table", show_default=True,
        help="Output format: table, wide (more columns), json, yaml. Under -w, json is one object per line.",
    )(f)


def no_headers_option(f: F) -> F:
    """``--no-headers``: tables without their header rows and titles."""
    return click.option("--no-headers", is_flag=True, default=False, help="Print tables without header rows.")(f)


@dataclass
class TableSpec:
    """A table to print: column names, rows of cell text, and which columns only ``-o wide`` shows.

    Attributes:
        columns: header names.
        rows: one list of cell strings per row, as long as ``columns``.
        title: shown on a line of its own above the table (not with ``--no-headers``).
        wide: names of the columns shown only under ``-o wide``.
    """

    columns: list[str]
    rows: list[list[str]]
    title: str = ""
    wide: frozenset[str] = field(default_factory=frozenset)

    def narrowed(self, wide: bool) -> TableSpec:
        """This table without its wide-only columns (unless ``wide``)."""
        if wide or not self.wide:
            return self
        keep = [i for i, c in enumerate(self.columns) if c not in self.wide]
        return TableSpec(
            [self.columns[i] for i in keep], [[r[i] for i in keep] for r in self.rows], self.title, frozenset()
        )


def plain_table(table: TableSpec, no_headers: bool = False) -> str:
    """Columns aligned with three spaces, no borders (kubectl's layout); ends with a newline."""
    lines = ([] if no_headers else [table.columns]) + table.rows
    if not lines:
        return ""
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(table.columns))]
    out = []
    for line in lines:
        cells = [str(c).replace("\n", " ").ljust(w) for c, w in zip(line, widths, strict=False)]
        out.append("   ".join(cells).rstrip())
    return "\n".join(out) + "\n"


def is_terminal() -> bool:
    """True when stdout is a terminal (tables get borders and colour there only)."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def print_sections(
    sections: Sequence[TableSpec | str],
    *,
    wide: bool = False,
    no_headers: bool = False,
    console: Any = None,
) -> None:
    """Print tables and lines of text: rich on a terminal, plain text elsewhere.

    Args:
        sections: tables and plain lines, in order.
        wide: show the wide-only columns.
        no_headers: leave out header rows and titles.
        console: the rich console to print to on a terminal (None: plain text on stdout).
    """
    if console is not None:
        from rich import box
        from rich.table import Table

        for s in sections:
            if isinstance(s, str):
                console.print(s, highlight=False, markup=False)
                continue
            t = s.narrowed(wide)
            rt = Table(
                title=None if no_headers else (t.title or None), title_justify="left", show_header=not no_headers,
                box=box.SIMPLE_HEAD,
            )
            for c in t.columns:
                rt.add_column(c)
            for r in t.rows:
                rt.add_row(*r)
            console.print(rt)
        return
    first = True
    for s in sections:
        if isinstance(s, str):
            click.echo(s)
            continue
        t = s.narrowed(wide)
        if not t.rows and no_headers:
            continue
        if not first:
            click.echo("")
        if t.title and not no_headers:
            click.echo(t.title)
        click.echo(plain_table(t, no_headers), nl=False)
        first = False


def emit_document(obj: Any, output: str, watching: bool = False) -> None:
    """Print ``obj`` as JSON or YAML (``output`` is ``json`` or ``yaml``).

    Under ``-w`` (``watching``), JSON is one compact object per line and YAML documents start
    with ``---``, so a reader can split the stream.
    """
    if output == "json":
        if watching:
            click.echo(json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")))
        else:
            click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))
        sys.stdout.flush()
        return
    if output == "yaml":
        try:
            import yaml
        except ModuleNotFoundError:  # pragma: no cover - PyYAML is a dependency of the CLI
            raise click.UsageError("-o yaml needs PyYAML: pip install pyyaml (or use -o json)") from None
        # Through JSON first: tuples, enums and the like become plain lists and strings.
        plain = json.loads(json.dumps(obj, default=str))
        text = yaml.safe_dump(plain, sort_keys=True, default_flow_style=False, allow_unicode=True)
        click.echo(("---\n" if watching else "") + text, nl=False)
        sys.stdout.flush()
        return
    raise ValueError(f"not a document format: {output!r}")
