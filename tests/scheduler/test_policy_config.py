"""The policy configuration (``scheduler/config.py``): one file and one set of defaults for
``gpupool coordinator`` and ``gpupool simulate``; errors name the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER, PolicyConfig, load_policy_config, parse_assignment
from gpupool_sdk.scheduler.types import SchedulerConfig
from gpupool_sdk.sim.runner import DEFAULT_POOL_CONFIG


def _file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "policy.toml"
    p.write_text(text)
    return p


def test_defaults_are_the_measured_policy_and_the_simulators() -> None:
    cfg = load_policy_config()
    assert cfg.scheduler == DEFAULT_SCHEDULER
    assert DEFAULT_POOL_CONFIG is DEFAULT_SCHEDULER  # the simulator runs what a deployment runs
    s = cfg.scheduler
    assert s.las_threshold_gpu_s == (1800.0, 18000.0, 180000.0) and s.las_preempt and s.use_remaining
    assert s.overcommit_ratio == 1.5 and s.aging_s_per_priority == 0 and s.max_wait_s == 0
    assert cfg.source == "defaults" and cfg.overridden == ()


def test_the_library_defaults_are_the_deployments() -> None:
    """A scheduler or simulator policy built without a config runs the defaults (not SchedulerConfig())."""
    from gpupool_sdk.scheduler.policy import Scheduler
    from gpupool_sdk.sim.pool_policy import PoolPolicy

    assert Scheduler().config is DEFAULT_SCHEDULER
    assert PoolPolicy().config is DEFAULT_SCHEDULER
    assert SchedulerConfig() != DEFAULT_SCHEDULER  # the neutral config is not what a deployment runs


def test_file_then_flags(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        """
[scheduler]
overcommit_ratio = 2
las_threshold_gpu_s = [600, 6000, 60000]
use_remaining = false
max_decisions = 64

[prices]
models = { "H100-80GB" = 2.5 }
qos_factor = { shared = 0.25 }
""",
    )
    cfg = load_policy_config(path, {"min_runtime_s": 300, "overcommit_ratio": 1.25})
    s = cfg.scheduler
    assert s.overcommit_ratio == 1.25  # the flag wins over the file
    assert s.las_threshold_gpu_s == (600.0, 6000.0, 60000.0) and s.use_remaining is False
    assert s.max_decisions == 64 and s.min_runtime_s == 300.0
    assert s.peak_margin == DEFAULT_SCHEDULER.peak_margin  # untouched fields keep the defaults
    assert cfg.prices is not None
    assert cfg.price_table().price_per_hour("H100-80GB", "shared") == pytest.approx(0.625)
    text = cfg.describe()
    assert "overcommit_ratio = 1.25  # flag" in text
    assert "use_remaining = false  # default true" in text
    assert cfg.to_dict()["scheduler"]["las_threshold_gpu_s"] == [600.0, 6000.0, 60000.0]


@pytest.mark.parametrize(
    ("text", "field", "fix"),
    [
        ("[scheduler]\novercommit = 1.5\n", "scheduler.overcommit", "did you mean 'overcommit_ratio'"),
        ("[schedular]\n", "schedular", "did you mean 'scheduler'"),
        ("[scheduler]\novercommit_ratio = 0.5\n", "scheduler.overcommit_ratio", ">= 1.0"),
        ("[scheduler]\nuse_remaining = 1\n", "scheduler.use_remaining", "true or false"),
        ("[scheduler]\nmax_decisions = 1.5\n", "scheduler.max_decisions", "integer"),
        ("[scheduler]\nlas_threshold_gpu_s = [36000, 3600]\n", "scheduler.las_threshold_gpu_s", "ascending"),
        ("[scheduler]\nlas_threshold_gpu_s = ['x']\n", "scheduler.las_threshold_gpu_s", "list of numbers"),
        ('[prices]\nmodels = { "H100-80GB" = -1 }\n', "prices.models.H100-80GB", ">= 0"),
        ("scheduler = 3\n", "scheduler", "must be a table"),
        ("[scheduler\n", "policy.toml", "not valid TOML"),
    ],
)
def test_bad_files_name_the_field_and_the_fix(tmp_path: Path, text: str, field: str, fix: str) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_policy_config(path)
    assert field in err.value.field
    assert str(path) in err.value.field  # the file is named too
    assert fix in str(err.value)


def test_missing_file_and_bad_flag_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_policy_config(tmp_path / "nope.toml")
    assert err.value.field == "--config" and "fix the path" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_policy_config(None, {"overcommit_ratio": 0.5}, {"overcommit_ratio": "--overcommit"})
    assert err.value.field == "--overcommit"


def test_parse_assignment() -> None:
    assert parse_assignment("use_remaining=false") == ("use_remaining", False)
    assert parse_assignment("las_threshold_gpu_s = [3600, 36000]") == ("las_threshold_gpu_s", [3600, 36000])
    assert load_policy_config(None, dict([parse_assignment("las_threshold_gpu_s=[]")])).scheduler.las_threshold_gpu_s == ()
    with pytest.raises(ConfigError, match="FIELD=VALUE"):
        parse_assignment("use_remaining")
    with pytest.raises(ConfigError, match="not a TOML value"):
        parse_assignment("min_runtime_s=ten")


def test_every_scheduler_field_can_be_set_from_a_file(tmp_path: Path) -> None:
    # The file accepts every SchedulerConfig field, with its current value (round trip of describe()).
    body = PolicyConfig().describe().split("[scheduler]\n", 1)[1]
    cfg = load_policy_config(_file(tmp_path, "[scheduler]\n" + body))
    assert cfg.scheduler == DEFAULT_SCHEDULER
    assert set(cfg.to_dict()["scheduler"]) == set(SchedulerConfig.__dataclass_fields__)


def test_coordinator_command_reads_the_file_and_refuses_a_bad_one(tmp_path: Path) -> None:
    from gpupool_sdk.cli.coordinator_cmd import coordinator

    bad = _file(tmp_path, "[scheduler]\nmax_decisions = 0\n")
    res = CliRunner().invoke(coordinator, ["--endpoints", "http://127.0.0.1:1", "--config", str(bad)])
    assert res.exit_code == 2 and "scheduler.max_decisions" in res.output and ">= 1" in res.output
    res = CliRunner().invoke(coordinator, ["--endpoints", "http://127.0.0.1:1", "--set", "overcommit=2"])
    assert res.exit_code == 2 and "overcommit_ratio" in res.output  # the suggestion
