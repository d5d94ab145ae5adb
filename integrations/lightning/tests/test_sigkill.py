"""A trainer killed with SIGKILL frees its slices before its lease could expire."""

from __future__ import annotations

import os
import signal

import pytest

from gpupool_sdk.store.records import TelemetryRecord
from integrations.lightning.tests.conftest import LivePool, wait_for

pytestmark = pytest.mark.slow

TTL_S = 30.0


def test_sigkilled_trainer_frees_its_slices_before_the_ttl(live_pool: LivePool) -> None:
    live_pool.start("node-a:1xA100-40GB")
    env = {"GPUPOOL_LEASE_TTL": str(TTL_S), "GPUPOOL_KEEPALIVE_INTERVAL": "2", "GPUPOOL_RETRY_TIMEOUT": "3"}
    p = live_pool.trainer("victim", "--name", "victim", "--memory", "30GiB", "--epochs", "50", "--step-sleep", "0.1",
                          env=env)
    wait_for(lambda: live_pool.store.get_record(live_pool.keys.telemetry("victim"), TelemetryRecord),
             what="the victim to train (telemetry)")
    assert live_pool.allocations("victim")
    os.kill(p.pid, signal.SIGKILL)  # the trainer only: its helper process must notice on its own
    assert p.wait(timeout=30) == -signal.SIGKILL
    # Freed well before the 30 s lease could expire: the helper revoked it when the trainer died.
    wait_for(lambda: not live_pool.allocations("victim") and live_pool.status("victim") is None,
             timeout=TTL_S * 0.8, what="the victim's allocations and status to vanish")
