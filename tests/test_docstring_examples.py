"""Every docstring example of the three packages runs and prints what it says.

The style guide asks for an ``Example:`` in public docstrings; this keeps them true. Examples that
need a live etcd, a GPU or a training process say ``# doctest: +SKIP`` on each line. They run in
a plain environment: no ``GPUPOOL_*`` variable (a runtime started by another test in this worker
exports ``GPUPOOL_JOB`` for its ranks, by design).
"""

from __future__ import annotations

import doctest
import importlib
import io
import os
import pkgutil

import pytest

PACKAGES = ("gpupool_sdk", "gpupool_torch", "gpupool_lightning")


def _modules() -> list[str]:
    names: list[str] = []
    for package in PACKAGES:
        try:
            root = importlib.import_module(package)
        except ImportError:  # an adapter that is not installed: its own tests skip too
            continue
        names.append(package)
        names.extend(info.name for info in pkgutil.walk_packages(root.__path__, package + "."))
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("GPUPOOL_")]:
        monkeypatch.delenv(var)
    module = importlib.import_module(name)
    out = io.StringIO()
    runner = doctest.DocTestRunner(verbose=False)
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):
        runner.run(test, out=out.write)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, out.getvalue()
