"""Building the C core, and the torch / CuPy hooks' CPU-side checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpupool_sdk.memory import InstallError, NativeBuildError, _native
from gpupool_torch.memory import torch_hook

REPO = Path(__file__).resolve().parents[3]


def test_missing_compiler_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "gpupool-no-such-compiler")
    with pytest.raises(NativeBuildError, match="no C compiler was found") as info:
        _native.find_compiler()
    assert "CC" in str(info.value) and "GPUPOOL_CACHE_DIR" in str(info.value)


def test_fresh_build_in_a_cache_dir(tmp_path: Path) -> None:
    # A new process with an empty cache compiles the core once, keyed by the source hash.
    code = (
        "from gpupool_sdk.memory import CachingAllocator, _native\n"
        "a = CachingAllocator('host'); p = a.malloc(10); a.free(p); a.close()\n"
        "print(_native.library_path())\n"
    )
    env = {"GPUPOOL_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True
    )
    built = Path(out.stdout.strip())
    assert built.parent == tmp_path and built.name.startswith("libgpupool_alloc-") and built.exists()
    assert list(tmp_path.glob(".build-*")) == []
    # A second process reuses it even without a compiler.
    env["CC"] = "gpupool-no-such-compiler"
    out2 = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out2.stdout.strip() == str(built)


def test_library_exports_the_pluggable_allocator_entry_points() -> None:
    lib = _native.load()
    for name in ("gpupool_torch_malloc", "gpupool_torch_free"):
        assert getattr(lib, name) is not None


def test_torch_entry_points_use_the_global_allocator() -> None:
    import ctypes

    lib = _native.load()
    malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(
        ("gpupool_torch_malloc", lib)
    )
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(
        ("gpupool_torch_free", lib)
    )
    assert malloc(1024, 3, None) is None  # no allocator for device 3: torch sees a failed allocation
    try:
        alloc = torch_hook.global_allocator(3, quota="4MiB", backend="host")
        assert torch_hook.installed_devices() == [3]
        p = malloc(1000, 3, None)
        assert p and alloc.stats()["requested_bytes.all.current"] == 1000
        assert malloc(8 << 20, 3, None) is None  # over the quota
        free(p, 1000, 3, None)
        assert alloc.stats()["allocation.all.current"] == 0
        assert torch_hook.empty_cache(3) == 2 << 20
        assert torch_hook.set_memory_fraction(0.5, device=3, total_bytes=2 << 20) == 0
        assert alloc.quota == 1 << 20
    finally:
        torch_hook._reset_for_tests()
    assert malloc(1024, 3, None) is None


def test_install_torch_allocator_refuses_after_cuda_init(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(InstallError, match="before CUDA initialises"):
        torch_hook.install_torch_allocator(quota="1GiB")
    assert not torch_hook.torch_allocator_installed()


def test_install_torch_allocator_needs_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InstallError, match="is_available"):
        torch_hook.install_torch_allocator()


def test_install_cupy_allocator_without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpupool_torch.memory import install_cupy_allocator

    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(InstallError, match="cupy"):
        install_cupy_allocator()


def test_oom_errors_are_torch_oom_errors() -> None:
    torch = pytest.importorskip("torch")
    from gpupool_sdk.errors import GpupoolError
    from gpupool_sdk.memory import DeviceOutOfMemoryError, QuotaExceededError

    for cls in (QuotaExceededError, DeviceOutOfMemoryError):
        assert issubclass(cls, torch.OutOfMemoryError) and issubclass(cls, GpupoolError)
