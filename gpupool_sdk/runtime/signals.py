"""Signals as preemptions: SIGTERM, SIGINT and Slurm's ``--signal`` mean "checkpoint and go".

The handler only records the signal (async-signal-safe: two attribute stores); the runtime acts
at the next step boundary. Handlers installed before (the user's, a framework's) are chained:
they run after ours. Python's default SIGINT handler (which raises ``KeyboardInterrupt`` in the
middle of a step) is not chained: a first Ctrl-C checkpoints; a second one interrupts at once.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

_Handler = Callable[[int, FrameType | None], Any]


class SignalWatch:
    """Records preemption signals for a runtime.

    Args:
        on_signal: called from the handler with the signal number (must only set flags).
    """

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self._on_signal = on_signal
        self._previous: dict[int, Any] = {}
        self.received: int | None = None

    def install(self, signums: tuple[int, ...]) -> bool:
        """Install the handlers (main thread only); returns False elsewhere (nothing installed)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in signums:
            if signum in self._previous:
                continue
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)
        return True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.received is None
        self.received = signum
        self._on_signal(signum)
        prev = self._previous.get(signum)
        if signum == signal.SIGINT and not first:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if callable(prev) and prev is not signal.default_int_handler:
            prev(signum, frame)

    def owns(self, handler: Any) -> bool:
        """True when ``handler`` is this watch's own (as :func:`signal.getsignal` returns it)."""
        return bool(handler == self._handle)

    def reinstall(self, signum: int) -> bool:
        """Put this watch's handler back for ``signum``, over one a framework installed after ours.

        For a framework whose own handler calls ours but also acts on the signal in a way that
        defeats the checkpoint (Lightning's SIGTERM stop). The handler found at :meth:`install`
        stays chained. Main thread only; returns False (nothing done) elsewhere or for a signal
        this watch does not handle.
        """
        if threading.current_thread() is not threading.main_thread() or signum not in self._previous:
            return False
        signal.signal(signum, self._handle)
        return True

    def uninstall(self) -> None:
        """Put back the handlers found at :meth:`install` (where ours is still the one installed)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, prev in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    @staticmethod
    def name(signum: int) -> str:
        try:
            return signal.Signals(signum).name
        except ValueError:
            return f"signal {signum}"
