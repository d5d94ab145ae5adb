"""Shared test harness for every package's tests (core tests/ and integrations/*/tests): one real
etcd per test session, a fresh key prefix per test.

Fixtures:
    etcd_server: the session's :class:`~gpupool_sdk.store.launcher.EtcdServer` (real etcd on loopback).
    etcd_endpoint: its ``host:port``.
    keyspace: a :class:`~gpupool_sdk.store.keyspace.Keyspace` under a fresh ``/gpupool-test/<uuid>``.
    store: an :class:`~gpupool_sdk.store.EtcdStore` on that keyspace, closed after the test.
    etcdctl: ``etcdctl(*args, input=None, check=True)`` -> ``CompletedProcess`` against the session etcd.

Helpers for the harnesses that run real processes live in ``tests/testkit.py`` (``wait_for``,
``dump_logs_if_failed``): a module of its own name, since several folders have a ``conftest``;
``tests/`` is put on ``sys.path`` here so that ``from testkit import ...`` works from every package.

Tests marked ``gpu`` are skipped when ``torch.cuda.is_available()`` is False.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.launcher import EtcdServer, find_etcdctl_binary

TEST_PREFIX_ROOT = "/gpupool-test"

_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

# A shell starts a background job (`scripts/test &`, a CI runner without a terminal) with SIGINT
# ignored, and every process the tests start would inherit that: the tests that press Ctrl-C on a
# `gpupool ... -w` (a real SIGINT) would then wait for ever. Tests model a terminal: SIGINT is
# handled here, so the children start with the default action and Python's KeyboardInterrupt.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for the whole session, on free ports, auto-compaction off."""
    data_dir = tmp_path_factory.mktemp("etcd-session") / "data"
    server = EtcdServer(data_dir=data_dir, name="gpupool-test", extra_args=["--auto-compaction-retention=0"])
    server.start(timeout=60)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def etcd_endpoint(etcd_server: EtcdServer) -> str:
    """``host:port`` of the session etcd."""
    return etcd_server.endpoint


@pytest.fixture
def keyspace() -> Keyspace:
    """A keyspace under a prefix no other test uses."""
    return Keyspace(f"{TEST_PREFIX_ROOT}/{uuid.uuid4().hex}")


@pytest.fixture
def store(etcd_endpoint: str, keyspace: Keyspace) -> Iterator[Any]:
    """An EtcdStore on the session etcd and this test's keyspace; its keys are deleted after the test."""
    from gpupool_sdk.store import EtcdStore

    s = EtcdStore(etcd_endpoint, keyspace=keyspace)
    try:
        yield s
    finally:
        try:
            s.delete_prefix(keyspace.root())
        finally:
            s.close()


@pytest.fixture(scope="session")
def etcdctl(etcd_endpoint: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``etcdctl --endpoints <session etcd> *args``; returns the CompletedProcess (text mode)."""
    binary = find_etcdctl_binary()
    env = {**os.environ, "ETCDCTL_API": "3"}

    def run(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [binary, f"--endpoints={etcd_endpoint}", *args],
            input=input,
            capture_output=True,
            text=True,
            check=check,
            env=env,
            timeout=30,
        )

    return run


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the run for parallel workers and skip GPU tests where there is no GPU.

    ``scripts/test`` runs the suite on several pytest-xdist workers (``--dist loadgroup``, one
    test at a time per worker). The long end-to-end tests (marked ``slow``) go first, so that they
    overlap each other instead of leaving one worker busy at the end; the order is stable and the
    same on every worker, as xdist requires.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    _skip_gpu_tests_without_a_gpu(items)


def _skip_gpu_tests_without_a_gpu(items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return  # do not pay for importing torch when no test needs a GPU
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except Exception:  # torch missing or broken: no GPU as far as tests are concerned
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each phase's report on the item (``item.rep_call``...) so fixtures can see a failure."""
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{rep.when}", rep)


_CPU_REPORT = os.environ.get("GPUPOOL_TEST_CPU_REPORT")


if _CPU_REPORT:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        """``GPUPOOL_TEST_CPU_REPORT=FILE``: append ``nodeid wall cpu_self cpu_children`` per test.

        For finding where the suite's CPU goes (the test command runs on two cores): children are
        the processes a test started and waited for (scripts, coordinators, CLIs), with theirs.
        """
        import resource
        import time

        def cpu(who: int) -> float:
            r = resource.getrusage(who)
            return r.ru_utime + r.ru_stime

        t0, s0, c0 = time.monotonic(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
        yield
        wall, own, kids = time.monotonic() - t0, cpu(resource.RUSAGE_SELF) - s0, cpu(resource.RUSAGE_CHILDREN) - c0
        with open(_CPU_REPORT, "a", encoding="utf-8") as f:
            f.write(f"{item.nodeid}\t{wall:.2f}\t{own:.2f}\t{kids:.2f}\n")
