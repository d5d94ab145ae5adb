"""GPU tests of the memory subsystem (skipped without a CUDA device).

Replace mode must be installed before CUDA initialises, so those scenarios run in a fresh
subprocess each; the torch-tier balloon round trip runs in this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MiB = 1 << 20


def run_script(body: str, timeout: float = 240) -> dict:
    """Runs a script in a fresh interpreter; its last stdout line is a JSON result."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)],
        cwd=Path(__file__).resolve().parents[3],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_replace_mode_trains_a_model_under_a_quota() -> None:
    result = run_script(
        """
        import json, torch
        from gpupool_sdk.memory import QuotaExceededError
        from gpupool_torch.memory import install_torch_allocator
        alloc = install_torch_allocator(quota="512MiB", devices=[0])
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses = []
        for step in range(30):
            x = torch.randn(256, 512, device="cuda"); y = torch.randint(0, 10, (256,), device="cuda")
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            losses.append(loss.item())
        st = alloc.stats()
        ooms = st["num_ooms"]
        try:
            big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            over = "no error, data_ptr %d" % big.data_ptr()
        except torch.OutOfMemoryError as e:
            over = type(e).__name__
        except RuntimeError as e:
            over = "RuntimeError: " + str(e)[:200]
        print(json.dumps({
            "refused": alloc.stats()["num_ooms"] == ooms + 1,
            "first": losses[0], "last": losses[-1],
            "reserved_peak": st["reserved_bytes.all.peak"], "allocated_peak": st["allocated_bytes.all.peak"],
            "allocations": st["allocation.all.allocated"], "quota": st["gpupool.quota_bytes"], "over": over,
        }))
        """
    )
    assert result["allocations"] > 100  # torch really allocated through the SDK's allocator
    assert result["reserved_peak"] <= result["quota"] == 512 * MiB
    assert result["last"] < result["first"]
    assert result["refused"]  # the SDK refused the over-quota request...
    assert result["over"] in ("OutOfMemoryError", "no error, data_ptr 0") or result["over"].startswith(
        "Runtime"
    )


def test_replace_mode_refuses_after_cuda_init() -> None:
    result = run_script(
        """
        import json, torch
        from gpupool_sdk.memory import InstallError
        from gpupool_torch.memory import install_torch_allocator
        torch.zeros(1, device="cuda")
        try:
            install_torch_allocator(quota="1GiB")
            print(json.dumps({"raised": False}))
        except InstallError as e:
            print(json.dumps({"raised": True, "message": str(e)}))
        """
    )
    assert result["raised"] and "before CUDA initialises" in result["message"]


def test_cupy_and_torch_share_one_quota() -> None:
    pytest.importorskip("cupy")
    result = run_script(
        """
        import json, torch, cupy
        from gpupool_sdk.memory import QuotaExceededError
        from gpupool_torch.memory import install_cupy_allocator, install_torch_allocator
        alloc = install_torch_allocator(quota="256MiB", devices=[0])
        assert install_cupy_allocator(devices=[0]) is alloc
        t = torch.empty(150 * 2**20, dtype=torch.uint8, device="cuda")
        after_torch = alloc.stats()["allocated_bytes.all.current"]
        a = cupy.empty(50 * 2**20, dtype=cupy.uint8)
        after_cupy = alloc.stats()["allocated_bytes.all.current"]
        try:
            cupy.empty(100 * 2**20, dtype=cupy.uint8)
            refused = False
        except QuotaExceededError:
            refused = True
        del a
        print(json.dumps({"after_torch": after_torch, "after_cupy": after_cupy, "refused": refused,
                          "after_free": alloc.stats()["allocated_bytes.all.current"]}))
        """
    )
    assert result["after_torch"] >= 150 * MiB
    assert result["after_cupy"] >= result["after_torch"] + 50 * MiB
    assert result["refused"]  # 150 + 50 + 100 MiB > 256 MiB: the quota is shared
    assert result["after_free"] == result["after_torch"]


def test_gpupool_tier_balloon_round_trip() -> None:
    result = run_script(
        """
        import json, torch
        from gpupool_torch.memory import install_torch_allocator, make_balloon_controller
        install_torch_allocator(quota="2GiB", devices=[0])
        model = torch.nn.Linear(2048, 2048).cuda()
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(64, 2048, device="cuda")).sum().backward(); opt.step()
        balloon = make_balloon_controller("gpupool", quota_bytes="2GiB")
        balloon.add_optimizer(opt)
        before = {(id(p), k): v.clone() for p, s in opt.state.items() for k, v in s.items()}
        inflated = balloon.inflate(40 * 2**20)
        on_host = all(v.device.type == "cpu" and v.is_pinned()
                      for s in opt.state.values() for k, v in s.items() if k != "step")
        deflated = balloon.deflate()
        same = all(torch.equal(v.cpu(), before[(id(p), k)].cpu()) for p, s in opt.state.items() for k, v in s.items())
        print(json.dumps({"offloaded": inflated.offloaded_bytes, "reached": inflated.reached_bytes,
                          "ok": inflated.ok, "restored": deflated.restored_bytes, "on_host": on_host,
                          "same": same, "state_on_gpu": all(v.is_cuda for s in opt.state.values()
                                                            for k, v in s.items() if k != "step")}))
        """
    )
    assert result["offloaded"] == 2 * 2048 * 2049 * 4 and result["on_host"]
    assert result["reached"] <= 40 * MiB and result["ok"]
    assert result["restored"] == result["offloaded"] and result["same"] and result["state_on_gpu"]


def test_torch_tier_balloon_round_trip() -> None:
    from gpupool_sdk.memory import make_balloon_controller

    device = torch.cuda.current_device()
    model = torch.nn.Linear(2048, 2048).to(device)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(64, 2048, device=device)).sum().backward()
    opt.step()
    scratch = [torch.empty(64 * MiB, dtype=torch.uint8, device=device) for _ in range(4)]
    del scratch  # cached by torch's allocator: the trim must give it back
    total = torch.cuda.get_device_properties(device).total_memory
    balloon = make_balloon_controller("torch", quota_bytes=total, device=device)
    balloon.add_optimizer(opt)
    before = {(id(p), k): v.clone() for p, s in opt.state.items() for k, v in s.items()}
    live_before = torch.cuda.memory_allocated(device)
    try:
        result = balloon.inflate(live_before // 2)
        assert result.released_bytes >= 256 * MiB
        assert result.offloaded_bytes == 2 * 2048 * 2049 * 4
        assert torch.cuda.memory_allocated(device) <= live_before - result.offloaded_bytes
        back = balloon.deflate()
        assert back.restored_bytes == result.offloaded_bytes
        for p, s in opt.state.items():
            for k, v in s.items():
                assert v.device == before[(id(p), k)].device and torch.equal(v, before[(id(p), k)])
    finally:
        balloon.set_quota(None)  # lift the memory fraction for the rest of the session


def test_gpupool_option_installs_the_allocator_and_balloons() -> None:
    # What GpuPoolCallback(allocator="gpupool") / PoolSession do right after the lease (issue 15).
    result = run_script(
        """
        import json, torch
        from gpupool_torch.memory import prepare_job_memory
        from gpupool_torch.session import memory_tier
        alloc = prepare_job_memory("gpupool", 512 << 20)
        model = torch.nn.Linear(1024, 1024).cuda()
        opt = torch.optim.Adam(model.parameters())
        for _ in range(5):
            opt.zero_grad(); model(torch.randn(256, 1024, device="cuda")).sum().backward(); opt.step()
        torch.cuda.synchronize()
        ctl = memory_tier("gpupool", 512 << 20)
        ctl.add_optimizer(opt)
        before = alloc.stats()["reserved_bytes.all.current"]
        res = ctl.inflate(8 << 20)
        back = ctl.deflate()
        print(json.dumps({"allocations": alloc.stats()["allocation.all.allocated"], "same": ctl.allocator is alloc,
                          "before": before, "reached": res.reached_bytes, "offloaded": res.offloaded_bytes,
                          "restored": back.restored_bytes, "device": ctl.device}))
        """
    )
    assert result["same"] and result["allocations"] > 10 and result["device"] == 0
    assert result["reached"] < result["before"] and result["offloaded"] > 0
    assert result["restored"] == result["offloaded"]
