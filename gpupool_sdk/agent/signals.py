"""Graceful-stop signal handlers that chain the handlers they replace.

The first SIGTERM or SIGINT sets the stop event (the agent then revokes its leases, so its GPUs
vanish from the pool at once) and calls the previous handler if it was a Python function
installed by the host (the interpreter defaults are not called: they would end the process
before the leases are revoked). A second signal restores the previous handlers and re-delivers
the signal: a stuck shutdown can always be cut short.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

_DEFAULTS: tuple[Any, ...] = (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler, None)


def install_stop_handlers(
    stop: threading.Event,
    wake: threading.Event | None = None,
    signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
) -> Callable[[], None]:
    """Make ``signals`` set ``stop`` (and ``wake``); returns a function that restores the old handlers.

    Must be called from the main thread (a Python rule for signal handlers).

    Args:
        stop: set on the first signal.
        wake: also set, so a loop waiting on it notices at once.
        signals: the signals to handle.
    """
    previous: dict[int, Any] = {}

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def handler(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            restore()
            os.kill(os.getpid(), signum)
            return
        stop.set()
        if wake is not None:
            wake.set()
        prev = previous.get(signum)
        if callable(prev) and prev not in _DEFAULTS:
            prev(signum, frame)

    for s in signals:
        previous[int(s)] = signal.signal(s, handler)
    return restore
