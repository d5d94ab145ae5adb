"""install_stop_handlers: sets the stop event, chains host handlers, a second signal forces."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from gpupool_sdk.agent.signals import install_stop_handlers


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    # CPython runs Python signal handlers in the main thread at the next bytecode boundary.
    for _ in range(100):
        time.sleep(0.001)


@pytest.fixture
def usr1():
    before = signal.getsignal(signal.SIGUSR1)
    yield signal.SIGUSR1
    signal.signal(signal.SIGUSR1, before)


def test_first_signal_sets_stop_and_chains_the_host_handler(usr1):
    calls: list[int] = []
    signal.signal(usr1, lambda signum, frame: calls.append(signum))
    stop, wake = threading.Event(), threading.Event()
    restore = install_stop_handlers(stop, wake, signals=(usr1,))
    _deliver(usr1)
    assert stop.is_set() and wake.is_set()
    assert calls == [usr1]
    restore()
    assert signal.getsignal(usr1) is not None and signal.getsignal(usr1) != signal.SIG_DFL


def test_second_signal_restores_and_redelivers(usr1):
    calls: list[int] = []
    host = lambda signum, frame: calls.append(signum)  # noqa: E731
    signal.signal(usr1, host)
    stop = threading.Event()
    install_stop_handlers(stop, signals=(usr1,))
    _deliver(usr1)
    _deliver(usr1)  # while stopping: the host handler is back in place and gets the signal again
    assert signal.getsignal(usr1) is host
    assert calls == [usr1, usr1]


def test_interpreter_default_handlers_are_not_called():
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stop = threading.Event()
        restore = install_stop_handlers(stop, signals=(signal.SIGINT,))
        _deliver(signal.SIGINT)  # would raise KeyboardInterrupt if the default handler were chained
        assert stop.is_set()
        restore()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
