"""``gpupool coordinator``'s autoscale flags: validated, and in force in a real coordinator process."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest

from gpupool_sdk.cli.coordinator_cmd import autoscale_settings, describe_autoscale
from gpupool_sdk.resources import JobState
from gpupool_sdk.scheduler.autoscale import AutoscaleSettings, AutoscaleSignal
from scenarios.harness import ROOT, Pool, wait_for

A = "A100-40GB"


def test_flags_build_the_settings_and_unset_flags_keep_the_defaults() -> None:
    assert autoscale_settings() == AutoscaleSettings()
    s = autoscale_settings(True, 0, 30, 1, 12, ("A100-40GB=4", " H100-80GB = 8 "), "A100-40GB")
    assert s == AutoscaleSettings(scale_up_after_s=0, scale_down_idle_s=30, min_nodes=1, max_nodes=12,
                                  gpus_per_node={"A100-40GB": 4, "H100-80GB": 8}, default_type="A100-40GB")
    assert autoscale_settings(False) is None
    assert describe_autoscale(None) == "# autoscale: off (--no-autoscale)"
    assert "gpus_per_node A100-40GB=4, H100-80GB=8" in describe_autoscale(s)


@pytest.mark.parametrize(
    ("kwargs", "flag", "words"),
    [
        ({"scale_up_after_s": -1.0}, "--scale-up-after", "seconds >= 0"),
        ({"scale_down_idle_s": float("inf")}, "--scale-down-idle", "finite"),
        ({"min_nodes": -1}, "--autoscale-min-nodes", "min_nodes <= max_nodes"),
        ({"min_nodes": 5, "max_nodes": 2}, "--autoscale-min-nodes", "min_nodes <= max_nodes"),
        ({"max_nodes": -1}, "--autoscale-max-nodes", "min_nodes <= max_nodes"),
        ({"gpus_per_node": ("H100-80GB",)}, "--autoscale-gpus-per-node", "TYPE=N"),
        ({"gpus_per_node": ("H100-80GB=0",)}, "--autoscale-gpus-per-node", "N >= 1"),
        ({"gpus_per_node": ("=8",)}, "--autoscale-gpus-per-node", "TYPE=N"),
        ({"default_type": " "}, "--autoscale-default-type", "GPU type"),
        ({"enabled": False, "max_nodes": 3}, "--no-autoscale", "--autoscale-max-nodes given with --no-autoscale"),
    ],
)
def test_bad_values_name_the_flag(kwargs: dict[str, object], flag: str, words: str) -> None:
    with pytest.raises(click.BadParameter) as e:
        autoscale_settings(**kwargs)  # type: ignore[arg-type]
    assert e.value.param_hint == flag and words in e.value.format_message()


def test_bad_flag_exits_2_naming_it(pool: Pool) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "gpupool_sdk.cli.main", "coordinator", "--endpoints", pool.endpoint, "--prefix",
         pool.keys.prefix, "--autoscale-gpus-per-node", "A100-40GB=four"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert r.returncode == 2 and "--autoscale-gpus-per-node" in r.stderr and "TYPE=N" in r.stderr, r.stderr


def _signal(pool: Pool) -> AutoscaleSignal | None:
    got = pool.store.get_record(pool.keys.autoscale(), AutoscaleSignal)
    return got[0] if got else None


def test_a_coordinator_process_publishes_with_the_flags_settings(pool: Pool) -> None:
    pool.gpus("node-a:2xA100-40GB:pcie")
    pool.coordinator("c1", "--no-preemption", "--scale-up-after", "0", "--autoscale-gpus-per-node", f"{A}=4",
                     "--autoscale-max-nodes", "3")
    pool.wait_leader()
    pool.submit("first", gpus=2, qos="exclusive").wait_state(JobState.GRANTED)
    pool.submit("second", gpus=2, qos="exclusive").wait_state(JobState.PENDING)
    # 2 GPUs pending, none free: one more node of 4 GPUs (the flag), not of 2 (the largest node here).
    s = wait_for(lambda: (x := _signal(pool)) is not None and x.desired.get(A) == 2 and x, what="a scale-up signal")
    assert s.current[A] == 1 and "+1 node(s) of 4" in s.reasons[A], s.reasons
    assert "# autoscale: scale_up_after 0s" in pool.log("coordinator-c1")
