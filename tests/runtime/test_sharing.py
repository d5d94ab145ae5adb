"""Sharing in the training runtime: the pure plan of a grant, the plan's transport, and JobSharing's policy.

The plan and the offload policy are pure (table tests, a stand-in gate and balloon); the real
processes (MPS environment observed by the job, two Lightning jobs taking turns) are in
``tests/scenarios/test_sharing_env.py`` and ``integrations/lightning/tests/test_timeslice_sharing.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from gpupool_sdk.client.timeslice import GateState
from gpupool_sdk.errors import ConfigError
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import Allocation, GiB, GpuInfo, QoS
from gpupool_sdk.runtime import PoolRuntime, RuntimeOptions
from gpupool_sdk.runtime.runtime import DirectiveInbox
from gpupool_sdk.runtime.sharing import (
    SHARING_ENV,
    JobSharing,
    SharingPlan,
    apply_environment,
    launcher_environment,
    plan_sharing,
)

N = "node-a"
GPUS = parse_cluster_spec("node-a:2xA100-80GB:pcie")
MIG = parse_cluster_spec("node-a:1xA100-80GB:mig=3g.40gb+3g.40gb")
PIPE = "/run/gpupool-mps/node-a/pipe"


def alloc(gpu: GpuInfo, share: float = 0.3, qos: QoS = QoS.GUARANTEED, mem: int = 20 * GiB, node: str = N) -> Allocation:
    return Allocation("job", node, gpu.uuid, gpu.index, mem, share, qos)


def with_mps(g: GpuInfo) -> GpuInfo:
    from dataclasses import replace

    return replace(g, mps_pipe_dir=PIPE)


@pytest.mark.parametrize(
    ("allocs", "gpus", "want"),
    [
        # a shared slice of a GPU without MPS: time-slicing on it, weighted by its share
        ([alloc(GPUS[0], 0.3)], GPUS, ("timeslice", GPUS[0].uuid, 0.3, (), {})),
        ([alloc(GPUS[1], 0.7, QoS.SHARED)], GPUS, ("timeslice", GPUS[1].uuid, 0.7, (), {})),
        # no record of the GPU: counts as no MPS
        ([alloc(GPUS[0], 0.5)], [], ("timeslice", GPUS[0].uuid, 0.5, (), {})),
        # whole GPUs: nothing to share
        ([alloc(GPUS[0], 1.0, QoS.EXCLUSIVE)], GPUS, ("none", None, 1.0, (), {})),
        # under MPS: the limits, no gate
        ([alloc(GPUS[0], 0.3)], [with_mps(g) for g in GPUS],
         ("mps", None, 1.0, (), {"CUDA_MPS_PIPE_DIRECTORY": PIPE, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
                                 "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20480M"})),
        # a multi-GPU shared job: one gate (on its first GPU), the other named as not covered
        ([alloc(GPUS[1], 0.5), alloc(GPUS[0], 0.5)], GPUS, ("timeslice", GPUS[0].uuid, 0.5, (GPUS[1].uuid,), {})),
        # a whole MIG instance: the hardware isolates it
        ([alloc(MIG[0], 1.0, QoS.EXCLUSIVE)], MIG, ("mig", None, 1.0, (), {})),
        # a MIG instance split by two guaranteed jobs: they take turns on it
        ([alloc(MIG[1], 0.5)], MIG, ("timeslice", MIG[1].uuid, 0.5, (), {})),
        # another node's slices do not count
        ([alloc(GPUS[0], 0.3, node="node-b")], GPUS, ("none", None, 1.0, (), {})),
        ([], GPUS, ("none", None, 1.0, (), {})),
    ],
)
def test_plan_of_a_grant(allocs: list[Allocation], gpus: list[GpuInfo], want: tuple[Any, ...]) -> None:
    p = plan_sharing(allocs, N, gpus)
    assert (p.mechanism, p.gpu_uuid, p.compute_share, p.ungated, dict(p.env)) == want


def test_sharing_off_plans_nothing() -> None:
    assert plan_sharing([alloc(GPUS[0])], N, [with_mps(g) for g in GPUS], enabled=False) == SharingPlan(node=N)


def test_plan_travels_through_the_environment_and_bad_text_names_the_variable() -> None:
    p = plan_sharing([alloc(GPUS[1], 0.5), alloc(GPUS[0], 0.5)], N, GPUS)
    back = SharingPlan.from_env(json.dumps(p.to_dict()))
    assert (back.mechanism, back.node, back.gpu_uuid, back.compute_share, back.ungated) == (
        "timeslice", N, GPUS[0].uuid, 0.5, (GPUS[1].uuid,))
    for bad in ("{oops", '{"mechanism": "magic"}', '{"mechanism": "timeslice"}', "[]"):
        with pytest.raises(ConfigError) as e:
            SharingPlan.from_env(bad)
        assert e.value.field == SHARING_ENV and "gpupool run" in str(e.value)


@dataclass
class FakeLease:
    node: str
    allocations: tuple[Allocation, ...]


class FakeClient:
    def __init__(self, gpus: list[GpuInfo]) -> None:
        self._gpus = gpus
        self.asked: list[str | None] = []

    def gpus(self, node: str | None = None) -> list[GpuInfo]:
        self.asked.append(node)
        return [g for g in self._gpus if node is None or g.node == node]


def test_launcher_environment_carries_mps_limits_and_the_plan() -> None:
    lease = FakeLease(N, (alloc(GPUS[1], 0.25, mem=10 * GiB),))
    env = launcher_environment(lease, FakeClient([with_mps(g) for g in GPUS]))
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == PIPE and json.loads(env[SHARING_ENV])["mechanism"] == "mps"
    env = launcher_environment(lease, FakeClient(GPUS))
    assert set(env) == {SHARING_ENV} and json.loads(env[SHARING_ENV])["gpu_uuid"] == GPUS[1].uuid
    # a launcher double without GPU records or allocations plans nothing
    assert json.loads(launcher_environment(object(), object())[SHARING_ENV])["mechanism"] == "none"


def test_apply_environment_sets_the_variables() -> None:
    environ: dict[str, str] = {"KEEP": "1"}
    assert apply_environment({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}, environ)  # no CUDA in this process
    assert environ == {"KEEP": "1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}


def test_on_lease_reads_the_gpu_records_and_applies_mps(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
        monkeypatch.delenv(k, raising=False)
    client = FakeClient([with_mps(g) for g in GPUS])
    s = JobSharing("job", DirectiveInbox())
    plan = s.on_lease(FakeLease(N, (alloc(GPUS[0], 0.3),)), client)
    import os

    assert plan.mechanism == "mps" and client.asked == [N]
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    # a lease double without allocations plans nothing and reads nothing
    assert JobSharing("job", DirectiveInbox()).on_lease(object(), client).mechanism == "none"


def test_from_launcher_and_sharing_off() -> None:
    text = json.dumps(plan_sharing([alloc(GPUS[0])], N, GPUS).to_dict())
    assert JobSharing("j", DirectiveInbox()).from_launcher({SHARING_ENV: text}).mechanism == "timeslice"
    assert JobSharing("j", DirectiveInbox(), mode="off").from_launcher({SHARING_ENV: text}).mechanism == "none"
    assert JobSharing("j", DirectiveInbox()).from_launcher({}).mechanism == "none"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"sharing": "on"}, "sharing"), ({"handover_offload": "sometimes"}, "handover_offload"),
     ({"timeslice_period_s": 0}, "timeslice_period_s"), ({"timeslice_period_s": float("nan")}, "timeslice_period_s")],
)
def test_runtime_options_are_validated(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        RuntimeOptions(memory="1GiB", **kwargs)
    assert e.value.field == field


# ------------------------------------------------------------------ the gate hooks (stand-ins)


class FakeGate:
    def __init__(self, fits: bool | None) -> None:
        self.state = GateState(alone=False, fits=fits)
        self.boundaries = 0
        self.closed = False

    def step_boundary(self) -> None:
        self.boundaries += 1

    def close(self) -> None:
        self.closed = True


class FakeBalloon:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def park(self) -> Any:
        self.calls.append("park")
        return type("R", (), {"offloaded_bytes": 100, "message": "parked"})()

    def unpark(self) -> Any:
        self.calls.append("unpark")
        return type("R", (), {"restored_bytes": 100})()


@pytest.mark.parametrize(
    ("offload", "fits", "parks"),
    [("auto", False, True), ("auto", True, False), ("auto", None, False), ("always", True, True),
     ("never", False, False)],
)
def test_hand_over_parks_memory_only_when_it_does_not_fit_or_always(offload: str, fits: bool | None, parks: bool) -> None:
    balloon = FakeBalloon()
    s = JobSharing("j", DirectiveInbox(), offload=offload, balloon=lambda: balloon)
    s.gate = FakeGate(fits)
    s._on_pause()
    s._on_resume()
    assert balloon.calls == (["park", "unpark"] if parks else [])
    assert (s.parks, s.parked_bytes, s.restored_bytes) == ((1, 100, 100) if parks else (0, 0, 0))


def test_contention_raises_attention_turns_wait_and_stop_restores() -> None:
    inbox = DirectiveInbox()
    balloon = FakeBalloon()
    s = JobSharing("j", inbox, offload="always", balloon=lambda: balloon)
    gate = FakeGate(True)
    s.gate = gate
    s._on_contention(True)
    assert inbox.contended and inbox.attention
    # take() keeps attention up while contended: the step boundary keeps taking its slow path
    inbox.take()
    assert inbox.attention
    s.turn()
    assert gate.boundaries == 1
    s._on_pause()  # parked, then training ends while waiting for the turn
    s.stop()
    assert gate.closed and not inbox.contended and balloon.calls == ["park", "unpark"]
    inbox.take()
    assert not inbox.attention


class _NoClient:
    endpoints = ("127.0.0.1:1",)


def test_a_runtime_alone_keeps_the_fast_path() -> None:
    """The step boundary of a runtime that shares nothing is untouched: no gate, one attribute read."""
    rt = PoolRuntime(RuntimeOptions(memory="1GiB", name="alone-job"), client=_NoClient())
    assert rt.sharing.plan.mechanism == "none" and not rt.inbox.contended
    calls: list[int] = []
    assert rt.step_boundary(lambda: calls.append(1) or 1, None).kind is None
    assert calls == [] and rt.sharing.gate is None
