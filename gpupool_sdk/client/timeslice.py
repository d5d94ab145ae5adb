"""Step-level time-slicing: jobs sharing one GPU take turns at step boundaries.

Two jobs on one GPU without enforcement both launch kernels at once and the GPU's own
scheduler splits its time about evenly, whatever compute share each was granted. The
:class:`TimeSliceGate` enforces the shares instead: at each step boundary the training loop
calls :meth:`TimeSliceGate.step_boundary`, which returns at once while this job holds the GPU's
turn and its quantum is not used up, and otherwise hands the turn on and blocks until it comes
back. Each member holds the turn for ``period_s * share / sum(shares)``, so over time the
members of a GPU get step time in proportion to their compute shares.

Coordination is through etcd, with a fenced token passed between the jobs (no coordinator in
the loop, see ``docs/architecture.md``): ``timeslice/{node}/{gpu}/turn`` names the holder and a
sequence number and is only ever replaced by compare-and-swap on its mod revision;
``timeslice/{node}/{gpu}/members/{job}`` says which jobs run a gate. The etcd side runs in a
keeper process of its own (:mod:`gpupool_sdk.client.timeslice_keeper`, started with
``subprocess`` like the client's I/O helper), so the training process never runs gRPC. This
module has no I/O of its own: the pure rules (who is next, how long a quantum is) and the
gate, which only reads what the keeper sends it over a pipe.

A job alone on its GPU (or sharing it only with jobs that run no gate) pays one attribute read
per step. When the keeper dies, the gate opens (the job runs unthrottled) rather than blocking
training forever.

Example:
    >>> gate = TimeSliceGate.start(job="bert-ft", node="node-a", gpu_uuid="GPU-1")  # doctest: +SKIP
    >>> for batch in loader:                                                           # doctest: +SKIP
    ...     gate.step_boundary()
    ...     train_step(batch)
    >>> gate.close()                                                                   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import Pipe
from typing import Any

from gpupool_sdk.errors import ConfigError, GpupoolError
from gpupool_sdk.resources._fields import opt, req

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TimeSliceSettings:
    """Timing of step-level time-slicing.

    Args:
        period_s: one round of turns; a member holds the turn for ``period_s * share / total``.
            Longer periods hand over less often (less switching), shorter ones keep each job's
            progress smoother. Steps longer than a quantum simply overrun it (a turn always
            lasts at least one step).
        overrun_s: a holder that has not handed the turn on this long after its quantum ended
            (stuck in a long validation, a checkpoint, or gone without a gate) loses it to the
            next member. Default: ``max(5, 2 * period_s)``.

    Raises:
        ConfigError: a value is not a finite positive number of seconds.
    """

    period_s: float = 2.0
    overrun_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("period_s", "overrun_s"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(name, f"must be a finite number of seconds > 0, got {v!r}")
            object.__setattr__(self, name, float(v))
        if self.overrun_s is None:
            object.__setattr__(self, "overrun_s", max(5.0, 2.0 * self.period_s))

    @property
    def overrun(self) -> float:
        return float(self.overrun_s or 0.0)


@dataclass(frozen=True)
class Turn:
    """The value of ``timeslice/{node}/{gpu}/turn``.

    Attributes:
        holder: the job whose turn it is.
        seq: increases with every hand-over (a gate starts a new quantum only on a new seq).
        since: wall-clock time the turn was given (for the overrun rule; the members of one
            GPU share one machine's clock).
        quantum_s: how long the holder may keep it.
    """

    holder: str
    seq: int
    since: float
    quantum_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"holder": self.holder, "seq": self.seq, "since": self.since, "quantum_s": self.quantum_s}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "turn") -> Turn:
        return cls(
            holder=req(d, "holder", str, where),
            seq=req(d, "seq", int, where),
            since=opt(d, "since", float, where, 0.0),
            quantum_s=opt(d, "quantum_s", float, where, 0.0),
        )


def quantum_s(job: str, shares: Mapping[str, float], period_s: float) -> float:
    """How long ``job`` holds the turn: ``period_s * share / sum(shares)``.

    Example:
        >>> round(quantum_s("a", {"a": 0.7, "b": 0.3}, 2.0), 6)
        1.4
    """
    total = sum(shares.values())
    if job not in shares or total <= 0:
        return period_s
    return period_s * shares[job] / total


def next_holder(members: Sequence[str], after: str | None) -> str:
    """The member after ``after`` in name order (wrapping); the first one when ``after`` is None or gone.

    Example:
        >>> next_holder(["a", "b", "c"], "b"), next_holder(["a", "c"], "b"), next_holder(["a", "b"], "b")
        ('c', 'c', 'a')
    """
    order = sorted(members)
    if not order:
        raise ValueError("no members to hand the turn to")
    if after is None:
        return order[0]
    for m in order:
        if m > after:
            return m
    return order[0]


def plan_turn(
    me: str,
    members: Mapping[str, float],
    turn: Turn | None,
    now: float,
    settings: TimeSliceSettings,
    handing_over: int | None = None,
) -> Turn | None:
    """The turn one member's keeper should write now, or None to leave the key as it is.

    Every member runs the same rule on the same etcd state, so they agree on the next holder;
    the write is a compare-and-swap, so when several try, one wins and the rest re-read.

    Args:
        me: this keeper's job.
        members: gated jobs that hold a slice of the GPU, with their compute shares.
        turn: the current turn (None when the key is absent).
        now: wall-clock time.
        settings: period and overrun.
        handing_over: the seq this job's gate finished its quantum on (it asks to pass the turn).

    Returns:
        The new turn, or None.
    """
    if len(members) < 2 or me not in members:
        return None
    names = sorted(members)

    def give(holder: str) -> Turn:
        seq = turn.seq + 1 if turn is not None else 1
        return Turn(holder, seq, now, quantum_s(holder, members, settings.period_s))

    if turn is None:
        return give(names[0])
    if turn.holder not in members:
        return give(next_holder(names, turn.holder))
    if turn.holder == me and handing_over == turn.seq:
        return give(next_holder(names, me))
    if turn.holder != me and now > turn.since + turn.quantum_s + settings.overrun:
        return give(next_holder(names, turn.holder))
    return None


@dataclass(frozen=True)
class GateState:
    """What the keeper last told the gate.

    Attributes:
        alone: no other gated job shares the GPU (the gate lets every step through).
        holder: the job whose turn it is, or None.
        seq: the turn's sequence number.
        quantum_s: this job's quantum when it holds the turn.
        members: number of gated jobs sharing the GPU.
        fits: whether the memory quotas of every job holding a slice of the GPU fit its memory
            together (None: the GPU's record is not readable). When they do not, the job handing
            the GPU over should move its state out of the way (the integration's offload).
    """

    alone: bool = True
    holder: str | None = None
    seq: int = 0
    quantum_s: float = 0.0
    members: int = 0
    fits: bool | None = None


class TimeSliceGate:
    """Blocks the training loop at step boundaries while another job sharing the GPU has its turn.

    Create it with :meth:`start` (which starts the etcd keeper process) and call
    :meth:`step_boundary` between steps, from the training thread.

    Args:
        job: this job's name.
        conn: the channel to the keeper (an end of a ``multiprocessing.Pipe``).
        proc: the keeper process, if this gate owns it.
        on_pause: called (training thread) when this job hands the GPU over and is about to wait:
            the place to make the switch cheap, e.g. offload optimizer state with the balloon
            controller when the sharers' memory does not fit together.
        on_resume: called when the turn comes back, before the next step (restore what
            ``on_pause`` moved).
        on_contention: called with True when another gated job starts sharing the GPU and with
            False when the job is alone again (or the keeper is gone), from the gate's reader
            thread: it lets the caller keep a flag its own fast path reads (it must be cheap).

    Attributes:
        held_s: seconds this job held the turn (quanta used, up to the last boundary).
        waited_s: seconds :meth:`step_boundary` blocked waiting for the turn.
        turns: turns received.
    """

    def __init__(
        self,
        job: str,
        conn: Any,
        proc: subprocess.Popen[bytes] | None = None,
        on_pause: Callable[[], None] | None = None,
        on_resume: Callable[[], None] | None = None,
        on_contention: Callable[[bool], None] | None = None,
    ) -> None:
        self.job = job
        self._conn = conn
        self._proc = proc
        self.on_pause = on_pause
        self.on_resume = on_resume
        self.on_contention = on_contention
        self._cond = threading.Condition()
        self._state = GateState()
        self._alone = True  # read without the lock on the fast path
        self._closed = False
        self._holding = False
        self._seq = 0
        self._handed = -1
        self._turn_start = 0.0
        self._turn_end = 0.0
        self.held_s = 0.0
        self.waited_s = 0.0
        self.turns = 0
        self._reader = threading.Thread(target=self._read_loop, name="gpupool-timeslice", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ start / close

    @classmethod
    def start(
        cls,
        job: str,
        node: str,
        gpu_uuid: str,
        compute_share: float | None = None,
        endpoints: str | Sequence[str] | None = None,
        prefix: str | None = None,
        settings: TimeSliceSettings | None = None,
        security: Any = None,
        start_timeout_s: float = 60.0,
        on_pause: Callable[[], None] | None = None,
        on_resume: Callable[[], None] | None = None,
        on_contention: Callable[[bool], None] | None = None,
    ) -> TimeSliceGate:
        """Start the keeper process for one GPU of this job and return the gate.

        Args:
            job: the job name (its allocation on the GPU gives its share).
            node: the GPU's node.
            gpu_uuid: the shared GPU.
            compute_share: the share to weigh the turns with; None: the job's allocation's.
            endpoints: etcd endpoints (default ``$GPUPOOL_ENDPOINTS``, else ``$ETCDCTL_ENDPOINTS``, else localhost).
            prefix: key prefix (default ``$GPUPOOL_PREFIX`` or ``/gpupool/v1``).
            settings: period and overrun.
            security: an :class:`~gpupool_sdk.store.security.EtcdSecurity` (default: from the environment).
            start_timeout_s: how long to wait for the keeper to connect.
            on_pause: see the class (called when handing the GPU over).
            on_resume: see the class (called when the turn comes back).
            on_contention: see the class (called when another gated job starts or stops sharing).

        Raises:
            GpupoolError: the keeper could not start or reach etcd.
        """
        from gpupool_sdk.store.endpoints import parse_endpoints
        from gpupool_sdk.store.keyspace import Keyspace
        from gpupool_sdk.store.security import EtcdSecurity

        if compute_share is not None and not 0.0 < float(compute_share) <= 1.0:
            raise ConfigError("compute_share", f"must be in (0, 1], got {compute_share}")
        sec = (security if security is not None else EtcdSecurity.from_env()).for_endpoints(endpoints)
        sec.load()
        cfg = {
            "endpoints": list(parse_endpoints(endpoints)),
            "prefix": Keyspace.from_env(prefix).prefix,
            "security": sec,
            "job": job,
            "node": node,
            "gpu_uuid": gpu_uuid,
            "compute_share": compute_share,
            "settings": settings or TimeSliceSettings(),
            "parent_pid": os.getpid(),
            "log_level": os.environ.get("GPUPOOL_HELPER_LOG_LEVEL"),
        }
        ours, theirs = Pipe(duplex=True)
        fd = theirs.fileno()
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpupool_sdk.client.timeslice_keeper", str(fd)], pass_fds=(fd,), stdin=subprocess.DEVNULL
        )
        theirs.close()
        ours.send(cfg)
        deadline = time.monotonic() + start_timeout_s
        while not ours.poll(0.1):
            if proc.poll() is not None:
                raise GpupoolError(f"the time-slicing keeper exited with code {proc.returncode} while starting")
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise GpupoolError("the time-slicing keeper did not start in time (is etcd reachable?)")
        hello = ours.recv()
        if hello.get("op") == "error":
            proc.wait()
            raise GpupoolError(f"the time-slicing keeper could not start: {hello.get('message')}")
        return cls(job, ours, proc, on_pause=on_pause, on_resume=on_resume, on_contention=on_contention)

    def close(self) -> None:
        """Leave the rotation: the keeper removes this job's membership and turn and exits."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._alone = True
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._conn.send({"op": "bye"})  # the keeper revokes its lease and exits; the reader sees EOF
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._reader.join(timeout=5)
        with contextlib.suppress(OSError):
            self._conn.close()

    def __enter__(self) -> TimeSliceGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ state

    @property
    def alone(self) -> bool:
        """True while no other gated job shares the GPU."""
        return self._alone

    @property
    def state(self) -> GateState:
        """What the keeper last reported."""
        return self._state

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError, TypeError, ValueError):  # EOF, or closed under us
                break
            if not isinstance(msg, dict) or msg.get("op") != "state":
                continue
            st = GateState(
                alone=bool(msg["alone"]),
                holder=msg.get("holder"),
                seq=int(msg.get("seq", 0)),
                quantum_s=float(msg.get("quantum_s", 0.0)),
                members=int(msg.get("members", 0)),
                fits=msg.get("fits"),
            )
            with self._cond:
                flipped = st.alone != self._alone
                self._state = st
                self._alone = st.alone
                self._cond.notify_all()
            if flipped:
                self._tell_contention(not st.alone)
        with self._cond:
            if not self._closed:
                log.warning("time-slicing keeper of job %s is gone; the job now runs without taking turns", self.job)
            flipped = not self._alone
            self._alone = True
            self._state = GateState()
            self._cond.notify_all()
        if flipped:
            self._tell_contention(False)

    def _tell_contention(self, contended: bool) -> None:
        if self.on_contention is None:
            return
        try:
            self.on_contention(contended)
        except Exception:  # noqa: BLE001 - a caller's hook must not stop the reader
            log.exception("time-slicing on_contention hook failed")

    # ------------------------------------------------------------------ the training loop's call

    def step_boundary(self) -> None:
        """Call between two training steps: returns at once unless another job should have the GPU now.

        Cheap when alone (one attribute read). Otherwise, when this job's quantum is used up it
        hands the turn on and blocks until its next turn; a turn lost to the overrun rule is
        waited for too.
        """
        if self._alone:
            if self._holding:
                self._stop_holding(time.monotonic())
            return
        self._contended()

    def _stop_holding(self, now: float) -> None:
        self._holding = False
        self.held_s += now - self._turn_start

    def _my_turn(self) -> bool:
        st = self._state
        return st.holder == self.job and st.seq != self._handed

    def _contended(self) -> None:
        with self._cond:
            now = time.monotonic()
            st = self._state
            if self._holding:
                if st.holder == self.job and st.seq == self._seq and now < self._turn_end:
                    return
                if st.holder == self.job and st.seq == self._seq:
                    self._handed = self._seq
                    with contextlib.suppress(OSError):
                        self._conn.send({"op": "done", "seq": self._seq})
                self._stop_holding(now)
            paused = False
            if not self._my_turn() and not self._alone and not self._closed and self.on_pause is not None:
                paused = True
                self._cond.release()  # the hook may take long (offload); the reader must go on
                try:
                    self.on_pause()
                finally:
                    self._cond.acquire()
            began = time.monotonic()
            while not self._alone and not self._closed and not self._my_turn():
                self._cond.wait(1.0)
            st = self._state
            now = time.monotonic()
            self.waited_s += now - began
            if not (self._alone or self._closed):
                self._holding = True
                self._seq = st.seq
                self.turns += 1
        if paused and self.on_resume is not None:
            self.on_resume()
        # The quantum starts after the resume hook: restoring state is not the job's GPU time.
        self._turn_start = time.monotonic()
        self._turn_end = self._turn_start + st.quantum_s
