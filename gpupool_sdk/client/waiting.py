"""Why a job waits, said out loud: the log lines :meth:`PoolClient.acquire` writes until the grant.

A job that waits for slices tells its user why within a few seconds, then again at growing
intervals (and at once when the reason changes):

* no agent has published any GPU (nothing to grant);
* no coordinator has answered (no leader writes the job's status);
* the PENDING reason the leader wrote (``queued: needs 2 x A100-80GB among 1 matching``).

:func:`explain_wait` is pure; :class:`WaitReporter` is the thread that calls it. Both run in the
training process but never on the training thread, and read only what the client already has
(the job's status, pushed by the I/O helper) plus the helper's list of published nodes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("gpupool_sdk.client")

#: Seconds after submission before the first explanation (a healthy pool grants well before).
FIRST_REPORT_S = 3.0
#: Seconds between repeats of an unchanged explanation: doubling from the first, up to the last.
REPEAT_S: tuple[float, ...] = (15.0, 30.0, 60.0, 120.0, 300.0)


def _ago(s: float) -> str:
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m"


def explain_wait(job: str, status: Any, waited_s: float, published_nodes: Sequence[str] | None) -> str:
    """One line saying why ``job`` is not granted yet.

    Args:
        job: the job name.
        status: the job's latest :class:`~gpupool_sdk.resources.JobStatus`, or None when no
            coordinator has written one.
        waited_s: seconds since the job was submitted.
        published_nodes: nodes whose agents publish GPUs (None: unknown).

    Example:
        >>> explain_wait("bert", None, 5.0, [])
        'job bert waiting 5s: no agent has published any GPU; start `gpupool agent` on the GPU machines (`gpupool status` lists nodes)'
    """
    head = f"job {job} waiting {_ago(waited_s)}"
    if status is None:
        if published_nodes is not None and not published_nodes:
            return (f"{head}: no agent has published any GPU; start `gpupool agent` on the GPU machines "
                    "(`gpupool status` lists nodes)")
        return (f"{head}: no coordinator has answered (no leader?); start `gpupool coordinator` or check "
                "`gpupool status` for the leader")
    state = getattr(status.state, "value", str(status.state))
    reason = status.reason or "no reason given"
    return f"{head}: {state}: {reason}"


class WaitReporter:
    """Logs :func:`explain_wait` for one job until :meth:`stop`.

    Args:
        job: the job name.
        status: returns the job's latest status (None before the coordinator wrote one).
        nodes: returns the published nodes, or raises/returns None when unknown.
        first_after_s: delay before the first line.
        repeat_s: delays between repeats of an unchanged line (the last one repeats); a changed
            reason is logged at once.
    """

    def __init__(
        self,
        job: str,
        status: Callable[[], Any],
        nodes: Callable[[], Sequence[str] | None],
        first_after_s: float = FIRST_REPORT_S,
        repeat_s: Sequence[float] = REPEAT_S,
    ) -> None:
        self.job = job
        self._status = status
        self._nodes = nodes
        self._first = first_after_s
        self._repeat = tuple(repeat_s) or (60.0,)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lines: list[str] = []

    def start(self) -> WaitReporter:
        """Start the reporting thread (a daemon: it never keeps a process alive)."""
        self._thread = threading.Thread(target=self._run, name=f"gpupool-wait-{self.job}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop reporting (the grant came, or acquire gave up)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _published(self) -> Sequence[str] | None:
        try:
            return self._nodes()
        except Exception:  # noqa: BLE001 - an unknown answer, not a reason to stop explaining
            return None

    def _run(self) -> None:
        t0 = time.monotonic()
        if self._stop.wait(self._first):
            return
        last, repeats = "", 0
        while not self._stop.is_set():
            status = self._status()
            nodes = self._published() if status is None else None
            line = explain_wait(self.job, status, time.monotonic() - t0, nodes)
            key = line.split(": ", 1)[1] if ": " in line else line  # the reason, without the elapsed time
            if key != last:
                repeats = 0
            last = key
            if self._stop.is_set():
                return
            log.warning("%s", line)
            self.lines.append(line)
            delay = self._repeat[min(repeats, len(self._repeat) - 1)]
            repeats += 1
            # Look again soon so that a changed reason is said at once, but repeat only after ``delay``.
            deadline = time.monotonic() + delay
            while not self._stop.is_set() and time.monotonic() < deadline:
                if self._stop.wait(min(2.0, self._first)):
                    return
                st = self._status()
                now_key = explain_wait(self.job, st, 0.0, self._published() if st is None else None)
                if now_key.split(": ", 1)[1] != last:
                    break
