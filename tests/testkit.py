"""Helpers shared by the harnesses that run real processes (``scenarios/``, ``integrations/``).

``tests/`` is on ``sys.path`` (its ``conftest.py`` puts it there), so ``from testkit import ...``
works from any test folder; ``from conftest import ...`` would not, because several folders have
a ``conftest`` module and the first one imported wins.

* ``wait_for``: poll a condition with a generous bound, failing with what was awaited.
* ``dump_logs_if_failed``: print the tail of the process logs of a failed test (needs the
  ``pytest_runtest_makereport`` hook of ``tests/conftest.py``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float = 30.0, what: str = "condition", interval: float = 0.05) -> T:
    """Poll ``cond`` until it returns something truthy (and return it); fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def dump_logs_if_failed(request: pytest.FixtureRequest, log_dir: Path, tail_chars: int = 5000) -> None:
    """Print the tail of every ``*.log`` in ``log_dir`` when the test's call phase failed."""
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for f in sorted(log_dir.glob("*.log")):
            sys.stderr.write(f"\n----- {f.name} (tail) -----\n{f.read_text(errors='replace')[-tail_chars:]}\n")
