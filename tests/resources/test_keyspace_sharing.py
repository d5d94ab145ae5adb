"""Keys of issue 16: time-slicing turn and members, the autoscale signal; built and parsed in one place."""

from __future__ import annotations

import pytest

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.store.keyspace import Keyspace, ParsedKey


def test_timeslice_and_autoscale_keys_round_trip() -> None:
    ks = Keyspace("/p")
    assert ks.timeslice_turn("n", "GPU-1") == "/p/timeslice/n/GPU-1/turn"
    assert ks.timeslice_member("n", "MIG-x-1", "job-a") == "/p/timeslice/n/MIG-x-1/members/job-a"
    assert ks.timeslice_prefix("n", "GPU-1") == "/p/timeslice/n/GPU-1/"
    assert ks.autoscale() == "/p/autoscale"
    assert ks.parse(ks.timeslice_turn("n", "GPU-1")) == ParsedKey("timeslice.turn", ("n", "GPU-1"))
    assert ks.parse(ks.timeslice_member("n", "GPU-1", "j")) == ParsedKey("timeslice.member", ("n", "GPU-1", "j"))
    assert ks.parse("/p/autoscale") == ParsedKey("autoscale", ())
    assert ks.parse("/p/timeslice/n/GPU-1/other") is None
    assert ks.parse("/p/autoscale/extra") is None
    with pytest.raises(ConfigError, match="job"):
        ks.timeslice_member("n", "GPU-1", "bad/job")
