import dataclasses

import pytest

from gpupool_sdk.errors import ConfigError, SpecError
from gpupool_sdk.resources import (
    Ack,
    Allocation,
    Checkpoint,
    Directive,
    DirectiveKind,
    GiB,
    GpuHealth,
    GpuInfo,
    JobSpec,
    JobState,
    JobStatus,
    LeaderRecord,
    NodeInfo,
    QoS,
    Topology,
)


def test_spec_normalises_strings():
    spec = JobSpec(name="bert-ft", gpus=2, memory="30GiB", qos="guaranteed", priority=10, topology="spread")
    assert spec.memory == 30 * GiB
    assert spec.qos is QoS.GUARANTEED
    assert spec.topology is Topology.SPREAD
    assert spec.min_gpus == spec.max_gpus == 2
    assert not spec.is_elastic


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "Bad_Name"}, "name"),
        ({"name": "-x"}, "name"),
        ({"name": "x" * 64}, "name"),
        ({"gpus": 0}, "gpus"),
        ({"gpus": "2"}, "gpus"),
        ({"memory": "lots"}, "memory"),
        ({"qos": "platinum"}, "qos"),
        ({"topology": "ring"}, "topology"),
        ({"compute_share": 0}, "compute_share"),
        ({"compute_share": 1.5}, "compute_share"),
        ({"qos": "exclusive", "compute_share": 0.5}, "compute_share"),
        ({"qos": "shared", "memory": 0}, "memory"),
        ({"gpus": 2, "min_gpus": 3}, "min_gpus"),
        ({"gpus": 4, "max_gpus": 2}, "min_gpus"),
        ({"priority": 1.5}, "priority"),
        ({"preempt_grace_s": -1}, "preempt_grace_s"),
    ],
)
def test_invalid_spec_names_the_field(kwargs, field):
    base = {"name": "job", "memory": "1GiB"}
    base.update(kwargs)
    with pytest.raises(SpecError) as err:
        JobSpec(**base)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:")


@pytest.mark.parametrize(
    ("kwargs", "field", "closest"),
    [
        ({"preempt_grace": 30}, "preempt_grace", "preempt_grace_s"),
        ({"min_runtime": 60}, "min_runtime", "min_runtime_s"),
        ({"gpu": 2}, "gpu", "gpus"),
        ({"memory_gb": 20}, "memory_gb", "memory"),
    ],
)
def test_misspelt_keyword_is_a_config_error_naming_the_closest_field(kwargs, field, closest):
    with pytest.raises(ConfigError) as err:
        JobSpec(name="job", memory="1GiB", **kwargs)
    assert isinstance(err.value, SpecError)
    assert err.value.field == field
    assert f"did you mean {closest!r}?" in str(err.value)


def test_keyword_with_no_close_field_lists_the_valid_ones():
    with pytest.raises(SpecError, match=r"^banana: unknown field of JobSpec; valid fields: anti_affinity, ") as err:
        JobSpec(name="job", memory="1GiB", banana=1)
    assert "did you mean" not in str(err.value)


def test_constructor_argument_mistakes_are_spec_errors_not_type_errors():
    with pytest.raises(SpecError, match=r"^name: is required"):
        JobSpec(memory="1GiB")  # type: ignore[call-arg]
    with pytest.raises(SpecError, match=r"^name: given twice"):
        JobSpec("a", name="b", memory="1GiB")  # type: ignore[misc]
    with pytest.raises(SpecError, match="positional arguments"):
        JobSpec(*(["a"] + [None] * len(dataclasses.fields(JobSpec))))  # type: ignore[misc]
    assert JobSpec("a", 2, "1GiB").gpus == 2  # positional arguments still work


def test_exclusive_may_leave_memory_unset():
    spec = JobSpec(name="big", qos="exclusive", gpus=8)
    assert spec.memory_bytes == 0
    assert "whole GPU" in spec.describe()


def test_spec_round_trip_and_unknown_field():
    spec = JobSpec(name="j", gpus=4, memory="10GiB", min_gpus=2, max_gpus=8, features=("bf16", "fp8", "bf16"))
    assert spec.features == ("bf16", "fp8")
    assert spec.is_elastic
    assert JobSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(SpecError, match=r"^spec\.gpu: unknown field of a job spec; did you mean 'gpus'\?"):
        JobSpec.from_dict({**spec.to_dict(), "gpu": 3})


def test_records_round_trip():
    health = GpuHealth(healthy=False, reasons=("xid 79",), temperature_c=70.0, xids=(79,))
    gpu = GpuInfo(
        uuid="GPU-1",
        node="n",
        index=0,
        model="H100-80GB",
        memory_bytes=80 * GiB,
        tflops={"bf16": 989.0},
        features=("bf16",),
        nvlink_peers=("GPU-2",),
        nvlink_island=0,
        health=health,
    )
    assert GpuInfo.from_dict(gpu.to_dict()) == gpu
    assert not gpu.healthy
    node = NodeInfo(name="n", hostname="h", agent_pid=1, gpu_count=1, backend="simulated", started_at=1.0)
    assert NodeInfo.from_dict(node.to_dict()) == node
    status = JobStatus(state=JobState.GRANTED, reason="ok", last_checkpoint=Checkpoint("/c", 10, 2.0), gpus=2)
    assert JobStatus.from_dict(status.to_dict()) == status
    alloc = Allocation("j", "n", "GPU-1", 0, GiB, 0.5, QoS.SHARED, term=3)
    assert Allocation.from_dict(alloc.to_dict()) == alloc
    d = Directive(DirectiveKind.BALLOON, seq=2, deadline=5.0, target={"memory_bytes": GiB})
    assert Directive.from_dict(d.to_dict()) == d
    ack = Ack(seq=2, step=7, reached_bytes=GiB)
    assert Ack.from_dict(ack.to_dict()) == ack
    leader = LeaderRecord("c1", 4, 1.0)
    assert LeaderRecord.from_dict(leader.to_dict()) == leader


def test_record_type_errors_name_the_field():
    with pytest.raises(SpecError, match=r"gpu\.memory_bytes"):
        GpuInfo.from_dict({"uuid": "u", "node": "n", "index": 0, "model": "m", "memory_bytes": "lots"})
    with pytest.raises(SpecError, match=r"directive\.kind"):
        Directive.from_dict({"kind": "explode", "seq": 1, "deadline": 0})
    with pytest.raises(SpecError, match=r"status\.state"):
        JobStatus.from_dict({"state": "NAPPING"})


def test_gpu_model_aliases_map_to_published_catalog_names():
    assert JobSpec(name="j", memory="1GiB", gpu_model="h100").gpu_model == "H100-80GB"
    assert JobSpec(name="j", memory="1GiB", gpu_model="A100-40GB").gpu_model == "A100-40GB"
    # Unknown to the catalog: kept as written (an NVML agent may publish it under that name).
    assert JobSpec(name="j", memory="1GiB", gpu_model="NVIDIA H100 NVL").gpu_model == "NVIDIA H100 NVL"
