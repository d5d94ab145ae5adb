"""Signals as preemptions: SIGTERM, SIGINT and Slurm's ``--signal`` mean "checkpoint and go".

The handler only records the signal (async-signal-safe: two attribute stores); the runtime acts
at the next step boundary, so the adapters install it only where step boundaries are about to come
(training starts): before that a signal keeps the process's own disposition (the default ends the
process at once, also inside a blocking call such as DDP's rendezvous, where a Python handler could
not even run). A signal the process ignores (``SIG_IGN``: ``nohup``, a background job of a
non-interactive shell) is left ignored, as Python itself does for SIGINT.

Handlers installed before (the user's, a framework's) are chained: they run after ours. Python's
default SIGINT handler (which raises ``KeyboardInterrupt`` in the middle of a step) is not chained:
a first Ctrl-C checkpoints; a second one, once the first was recorded, interrupts at once. (Two
SIGINTs that arrive before the first reached Python's handler are one: the kernel merges a pending
signal with a second of its kind, and Python runs a handler once for all the deliveries since it
last ran it.)
Once uninstalled, a handler of ours that a framework put back records nothing and hands the
signal to the handler found before ours (see :class:`SignalWatch`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

_Handler = Callable[[int, FrameType | None], Any]


class SignalWatch:
    """Records preemption signals for a runtime.

    The handlers found at :meth:`install` are kept after :meth:`uninstall`: a framework that saved
    this watch's handler while it was installed may put it back later (Lightning restores, at the
    end of ``fit``, the handlers it found at its start). Such a stale handler records nothing: it
    puts the handler found at :meth:`install` back and hands it the signal (the default action
    included: a stale SIGTERM handler over ``SIG_DFL`` terminates the process), so the signal is
    never swallowed.

    Args:
        on_signal: called from the handler with the signal number (must only set flags).
    """

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self._on_signal = on_signal
        #: The handler found at install, per signal; kept after uninstall (see the class docstring).
        self._previous: dict[int, Any] = {}
        #: The signals this watch handles now (installed and not uninstalled).
        self._active: set[int] = set()
        self.received: int | None = None

    @property
    def active(self) -> bool:
        """True while the watch handles at least one signal (between install and uninstall)."""
        return bool(self._active)

    def previous(self, signum: int) -> Any:
        """The handler found for ``signum`` at :meth:`install` (``SIG_DFL`` if none was recorded)."""
        prev = self._previous.get(signum)
        return prev if prev is not None else signal.SIG_DFL

    def install(self, signums: tuple[int, ...], found: Mapping[int, Any] | None = None) -> bool:
        """Install the handlers (main thread only); returns False elsewhere (nothing installed).

        Also after :meth:`uninstall` (the watch handles the signals again), and again while
        installed (idempotent where this watch's handler is the one in place). Where the handler in
        place is this watch's own (put back by a framework), the one found at the first install
        stays the one chained. A signal whose disposition is ``SIG_IGN`` is left ignored.

        Args:
            signums: the signals to handle.
            found: the handlers a framework found before it put its own in place for this run
                (Lightning's signal connector); where given, the one found is chained (and decides
                ``SIG_IGN``), not the framework's own, which would act on the signal itself.
        """
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in signums:
            current = signal.getsignal(signum)
            if signum in self._active and self.owns(current):
                continue
            if not self.owns(current):
                own = found.get(signum, current) if found is not None else current
                if self.owns(own):
                    own = self.previous(signum)
                if own == signal.SIG_IGN:
                    continue  # the process ignores it (nohup, `&`): it stays ignored
                self._previous[signum] = own
            signal.signal(signum, self._handle)
            self._active.add(signum)
        return True

    def record(self, signum: int) -> None:
        """Record ``signum`` as if this watch's handler had received it (a framework's handler did)."""
        self.received = signum
        self._on_signal(signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum not in self._active:
            self._forward_stale(signum, frame)
            return
        first = self.received is None
        self.received = signum
        self._on_signal(signum)
        prev = self._previous.get(signum)
        if signum == signal.SIGINT and not first:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if callable(prev) and prev is not signal.default_int_handler:
            prev(signum, frame)

    def _forward_stale(self, signum: int, frame: FrameType | None) -> None:
        """This watch is uninstalled but its handler was called: act as the handler found at install.

        Where ours is the handler in place, the previous one is put back and gets the signal
        (``SIG_DFL``: the signal is raised again, so its default action happens; ``SIG_IGN``:
        nothing). Where another handler chained ours, only a callable previous handler is called.
        """
        prev = self.previous(signum)
        if self.owns(signal.getsignal(signum)):
            signal.signal(signum, prev)  # handlers run in the main thread
            if prev == signal.SIG_DFL:
                signal.raise_signal(signum)
                return
        if callable(prev):
            prev(signum, frame)

    def owns(self, handler: Any) -> bool:
        """True when ``handler`` is this watch's own (as :func:`signal.getsignal` returns it)."""
        return bool(handler == self._handle)

    def uninstall(self) -> None:
        """Put back the handlers found at :meth:`install` wherever ours is the one installed.

        Idempotent, and also after the watch was uninstalled: a call puts the previous handlers
        back over this watch's handler where a framework restored it since.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        self._active.clear()
        for signum in self._previous:
            if self.owns(signal.getsignal(signum)):
                signal.signal(signum, self.previous(signum))

    @staticmethod
    def name(signum: int) -> str:
        try:
            return signal.Signals(signum).name
        except ValueError:
            return f"signal {signum}"
