"""Grant -> environment: CUDA_VISIBLE_DEVICES entries and the CUDA MPS limits (pure), plus a real-GPU check."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from testkit import mps_control_daemon

from gpupool_sdk.client.mps import mps_environment, thread_percentage, visible_devices
from gpupool_sdk.resources import Allocation, GiB, QoS


def alloc(uuid: str, index: int, share: float = 0.3, memory: int = 20 * GiB, mode: QoS = QoS.GUARANTEED, node: str = "n") -> Allocation:
    return Allocation("job", node, uuid, index, memory, share, mode)


def test_visible_devices_order_and_mig_by_uuid() -> None:
    allocs = [alloc("GPU-b", 3), alloc("GPU-a", 1), alloc("MIG-x", 0), alloc("GPU-c", 2, node="other")]
    assert visible_devices(allocs, "n") == ["MIG-x", "1", "3"]
    assert visible_devices(allocs, "nowhere") == []


@pytest.mark.parametrize(("share", "pct"), [(0.3, 30), (0.25, 25), (0.333, 34), (0.001, 1), (1.0, 100), (0.7, 70)])
def test_thread_percentage(share: float, pct: int) -> None:
    assert thread_percentage(share) == pct


def test_mps_environment_from_a_grant() -> None:
    allocs = [alloc("GPU-b", 3, memory=10 * GiB), alloc("GPU-a", 1, memory=20 * GiB + 123)]
    env = mps_environment(allocs, "n", pipe_dir="/run/gpupool-mps/pipe", log_dir="/run/gpupool-mps/log")
    assert env == {
        "CUDA_MPS_PIPE_DIRECTORY": "/run/gpupool-mps/pipe",
        "CUDA_MPS_LOG_DIRECTORY": "/run/gpupool-mps/log",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
        # ordinal 0 is GPU index 1 (CUDA_VISIBLE_DEVICES order), limits rounded down to whole MiB
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20480M,1=10240M",
    }


def test_no_mps_no_env_and_exclusive_gets_no_limits() -> None:
    assert mps_environment([alloc("GPU-a", 0)], "n", pipe_dir=None) == {}
    assert mps_environment([], "n", pipe_dir="/p") == {}
    ex = mps_environment([alloc("GPU-a", 0, share=1.0, memory=80 * GiB, mode=QoS.EXCLUSIVE)], "n", pipe_dir="/p")
    assert ex == {"CUDA_MPS_PIPE_DIRECTORY": "/p"}
    mixed = mps_environment([alloc("MIG-a", 0), alloc("GPU-b", 1, share=0.5, memory=GiB)], "n", pipe_dir="/p")
    assert mixed["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "1=1024M" and mixed["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


PROBE = textwrap.dedent(
    """
    import json, torch
    free, total = torch.cuda.mem_get_info(0)
    try:
        torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
        over = "allocated"
    except RuntimeError as e:
        over = "refused: " + str(e).splitlines()[0]
    print(json.dumps({"total": total, "over_limit": over}))
    """
).replace("import json, torch", "import json, sys, torch")


@pytest.mark.gpu
def test_mps_limits_hold_on_a_real_gpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Under a real MPS control daemon, the pinned memory limit from a grant is enforced by the driver."""
    with mps_control_daemon(tmp_path) as (pipe, log, _):
        grant = [alloc("GPU-x", 0, share=0.25, memory=2 * GiB, node="here")]
        env = {**os.environ, **mps_environment(grant, "here", pipe_dir=pipe, log_dir=log), "CUDA_VISIBLE_DEVICES": "0"}
        out = subprocess.run([sys.executable, "-c", PROBE, str(3 * GiB)], env=env, capture_output=True, text=True, timeout=120)
        print(out.stdout, out.stderr)
        assert out.returncode == 0, out.stderr
        assert "refused" in out.stdout  # 3 GiB over a 2 GiB pinned limit
