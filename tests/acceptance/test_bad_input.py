"""Bad input from an ML engineer's Python: a clear error naming the field and the fix, and nothing written.

Covers :class:`JobSpec` and sizes, the values read back from etcd (strict JSON), the
:class:`PoolClient` arguments (checked before anything reaches etcd) and the scheduler settings.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from gpupool_sdk import JobSpec, PoolClient
from gpupool_sdk.errors import ConfigError, SchemaError, SpecError, UnknownGpuModelError
from gpupool_sdk.inventory.catalog import known_names, lookup_model
from gpupool_sdk.resources import GpuInfo, parse_size
from gpupool_sdk.scheduler.types import SchedulerConfig
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.codec import decode, decode_dict, encode

OK: dict[str, Any] = {"name": "bert-ft", "gpus": 1, "memory": "10GiB"}


@pytest.mark.parametrize(
    ("fields", "field", "hint"),
    [
        ({"memory": "lots"}, "memory", "24GiB"),
        ({"memory": "10 parsecs"}, "memory", "GiB"),
        ({"memory": "-1GiB"}, "memory", "24GiB"),
        ({"memory": -5}, "memory", ">= 0"),
        ({"memory": math.nan}, "memory", "finite"),  # was a bare ValueError from int(nan)
        ({"memory": math.inf}, "memory", "finite"),  # was an OverflowError from int(inf)
        ({"memory": 0, "qos": "guaranteed"}, "memory", "memory='20GiB'"),
        ({"gpus": 0}, "gpus", ">= 1"),
        ({"gpus": "2"}, "gpus", "int"),
        ({"gpus": True}, "gpus", "boolean"),
        ({"qos": "gold"}, "qos", "'exclusive', 'guaranteed', 'shared'"),
        ({"topology": "ring"}, "topology", "'pack', 'spread', 'any'"),
        ({"compute_share": 1.5}, "compute_share", "(0, 1]"),
        ({"compute_share": math.nan}, "compute_share", "(0, 1]"),
        ({"priority": 1.5}, "priority", "int"),
        ({"min_runtime_s": -1.0}, "min_runtime_s", ">= 0"),
        ({"min_runtime_s": math.nan}, "min_runtime_s", "finite"),  # was accepted
        ({"preempt_grace_s": math.inf}, "preempt_grace_s", "finite"),  # was accepted (deadline = inf)
        ({"features": "bf16"}, "features", "['bf16']"),  # was split into ('1', '6', 'b', 'f')
        ({"features": ("bf16", 3)}, "features", "['bf16']"),  # was a TypeError from sorted()
        ({"name": "Bad Name!"}, "name", "lowercase"),
        ({"min_gpus": 2}, "min_gpus", "min_gpus <= gpus"),
        ({"owner": None}, "owner", "str"),
    ],
)
def test_a_bad_job_spec_names_the_field_and_the_fix(fields: dict[str, Any], field: str, hint: str) -> None:
    with pytest.raises(SpecError) as err:
        JobSpec(**{**OK, **fields})
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")
    assert hint in str(err.value)


def test_a_spec_from_json_names_unknown_and_mistyped_fields() -> None:
    with pytest.raises(SpecError, match=r"spec\.memroy: unknown field.*did you mean 'memory'"):
        JobSpec.from_dict({**OK, "memroy": "1GiB"})
    with pytest.raises(SpecError, match=r"spec\.gpus: expected int"):
        JobSpec.from_dict({**OK, "gpus": "two"})


@pytest.mark.parametrize("raw", ["lots", "1e3GiB", "GiB", "", "12 XB"])
def test_a_bad_size_string_says_how_to_write_one(raw: str) -> None:
    with pytest.raises(SpecError, match=r"^memory: .*(24GiB|GiB)"):
        parse_size(raw, "memory")


def test_an_unknown_gpu_model_lists_every_known_one() -> None:
    with pytest.raises(UnknownGpuModelError) as err:
        lookup_model("H999-80GB", "gpu_model")
    assert str(err.value).startswith("gpu_model: unknown GPU model 'H999-80GB'")
    assert all(name in str(err.value) for name in known_names())


# ---------------------------------------------------------------- values read back from etcd


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ('{"schema": 1, "v": NaN}', "NaN"),
        ('{"schema": 1, "v": -Infinity}', "-Infinity"),
        ('{"schema": 1, "v": 1e999}', "1e999"),
        ('{"schema": 1, "v": ' + "[" * 5000 + "]" * 5000 + "}", "nested too deeply"),  # was a RecursionError
        ("[1]", "expected a JSON object"),
        ('{"schema": 2}', "upgrade gpupool-sdk"),
    ],
)
def test_a_value_that_is_not_strict_json_is_a_schema_error_naming_the_key(raw: str, needle: str) -> None:
    with pytest.raises(SchemaError) as err:
        decode_dict("/gpupool/v1/usage/x", raw)
    assert err.value.key == "/gpupool/v1/usage/x" and needle in str(err.value)


def test_record_fields_that_cannot_be_used_are_schema_errors_naming_the_field() -> None:
    spec = json.loads(encode(JobSpec(**OK)))
    with pytest.raises(SchemaError, match=r"jobs/a/spec: invalid value: features: expected a list of strings"):
        decode("/p/jobs/a/spec", json.dumps({**spec, "features": ["bf16", 7]}), JobSpec)
    gpu = json.loads(encode(GpuInfo(uuid="GPU-1", node="n", index=0, model="T4-16GB", memory_bytes=16 << 30)))
    for field in ("features", "nvlink_peers"):
        # A non-string feature used to pass, then crash the scheduler's sort of GPU classes.
        with pytest.raises(SchemaError, match=rf"invalid value: GPU-1\.{field}: expected a list of strings"):
            decode("/p/gpus/n/GPU-1", json.dumps({**gpu, field: ["nvlink", None]}), GpuInfo)


# ---------------------------------------------------------------- the PoolClient writes nothing on bad input


def test_the_pool_client_refuses_bad_arguments_before_writing_anything(etcd_endpoint: str, store: EtcdStore) -> None:
    prefix = store.keys.prefix
    for kwargs, field in (({"timeout_s": math.nan}, "timeout_s"), ({"timeout_s": math.inf}, "timeout_s"),
                          ({"telemetry_interval_s": math.nan}, "telemetry_interval_s"), ({"prefix": "relative"}, "prefix"),
                          ({"endpoints": "no port"}, "endpoints")):
        with pytest.raises(ConfigError) as err:
            PoolClient(endpoints=kwargs.pop("endpoints", etcd_endpoint), prefix=kwargs.pop("prefix", prefix), **kwargs)
        assert err.value.field == field
    with PoolClient(endpoints=etcd_endpoint, prefix=prefix) as pool:
        with pytest.raises(ConfigError, match="^spec: expected a JobSpec, got dict"):
            pool.acquire({"name": "x", "gpus": 1, "memory": "1GiB"})  # type: ignore[arg-type]
        # NaN used to fail with "did not answer acquire within nans", infinity with an OverflowError.
        for timeout in (-1.0, math.nan, math.inf):
            with pytest.raises(ConfigError, match="^timeout: .*finite.*or None"):
                pool.acquire(JobSpec(**OK), timeout=timeout)
        with pytest.raises(SpecError, match="^memory"):
            pool.acquire(JobSpec(**{**OK, "memory": "lots"}))
    kvs, _ = store.get_prefix(store.keys.root())
    assert kvs == [], [kv.key for kv in kvs]


# ---------------------------------------------------------------- scheduler settings


@pytest.mark.parametrize("field", ["overcommit_ratio", "min_runtime_s", "aging_s_per_priority", "preempt_grace_s"])
def test_scheduler_settings_refuse_nan(field: str) -> None:
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(**{field: math.nan})  # type: ignore[arg-type]
    assert err.value.field == field
