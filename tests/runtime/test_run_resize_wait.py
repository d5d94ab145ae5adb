"""`gpupool run` after a resize ack: what ends its wait for the re-grant (issue 15).

The predicate reads the launcher's lease (its status and allocations, as the client's watch keeps
them); the coordinator side is ``tests/coordinator/test_resize_protocol.py`` against a real etcd.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from gpupool_sdk.cli.run_cmd import _regranted_since
from gpupool_sdk.resources import JobState, JobStatus

ACKED_AT = 1000.0


@dataclass
class LeaseState:
    """The attributes of a client ``Lease`` the predicate reads."""

    status: JobStatus | None
    allocations: tuple[Any, ...] = field(default_factory=tuple)
    lost: bool = False


@pytest.mark.parametrize(
    ("lease", "done"),
    [
        # Still PREEMPTING (checkpointing, or the ack not handled yet): keep waiting.
        (LeaseState(JobStatus(JobState.PREEMPTING, "grow", granted_at=900.0), ("a",)), False),
        # The re-grant, written in the cycle of the ack (one transaction with the release).
        (LeaseState(JobStatus(JobState.GRANTED, "resize to 2 GPU(s) acknowledged", granted_at=1002.0), ("a", "b")), True),
        # The grant from before the resize: not the re-grant.
        (LeaseState(JobStatus(JobState.GRANTED, "granted", granted_at=900.0), ("a",)), False),
        # A preemption superseded the resize and took the slices back at its ack: stop waiting.
        (LeaseState(JobStatus(JobState.SUSPENDED, "preempted at step 9: node draining")), True),
        # The lease is gone.
        (LeaseState(None, lost=True), True),
    ],
)
def test_the_wait_for_the_re_grant_ends_on_a_re_grant_a_superseding_preemption_or_a_loss(
    lease: LeaseState, done: bool
) -> None:
    assert _regranted_since(ACKED_AT)(lease) is done
