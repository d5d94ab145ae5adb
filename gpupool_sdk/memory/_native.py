"""Builds and loads the allocator's C core.

The package ships ``csrc/allocator.c`` as package data. At first use it is compiled with the
system C compiler into a per-user cache directory, keyed by a hash of the sources, the
compiler and the Python ABI tag, and loaded with :mod:`ctypes`. No CUDA headers are needed:
the CUDA backend finds ``libcudart`` with ``dlopen`` at run time.

Environment variables:
    ``CC``: the C compiler (default: ``cc``, then ``gcc``, then ``clang``).
    ``GPUPOOL_CACHE_DIR``: where the built library is cached (default
    ``$XDG_CACHE_HOME/gpupool`` or ``~/.cache/gpupool``).
    ``GPUPOOL_CUDART_PATH``: an explicit ``libcudart.so`` for the CUDA backend.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from gpupool_sdk.errors import GpupoolError

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("allocator.c",)
HEADERS = ("allocator.h",)
CFLAGS = ("-O2", "-std=c11", "-shared", "-fPIC", "-pthread", "-fvisibility=default")
LDLIBS = ("-ldl",)

# Must match allocator.h.
ST_NAMES = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
COUNTER_NAMES = (
    "num_alloc_retries",
    "num_ooms",
    "num_device_alloc",
    "num_device_free",
    "num_sync_all_streams",
    "quota",
    "target",
    "free_bytes",
    "largest_free_block",
    "pending_blocks",
    "pending_bytes",
    "released_bytes_total",
)
STATS_LEN = len(ST_NAMES) * 3 * 4 + len(COUNTER_NAMES)
SNAPSHOT_COLS = 8

GP_OK = 0
GP_ERR_QUOTA = 1
GP_ERR_DEVICE = 2
GP_ERR_INVALID = 3
BACKEND_HOST = 0
BACKEND_CUDA = 1


class NativeBuildError(GpupoolError):
    """The allocator's C core could not be compiled or loaded."""


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: Path | None = None


def cache_dir() -> Path:
    """Returns the directory holding built libraries (``GPUPOOL_CACHE_DIR`` overrides it)."""
    env = os.environ.get("GPUPOOL_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "gpupool"


def find_compiler() -> str:
    """Returns the C compiler to use.

    Raises:
        NativeBuildError: no compiler is on ``PATH`` and ``CC`` is unset or wrong.
    """
    env = os.environ.get("CC")
    candidates = [env] if env else ["cc", "gcc", "clang"]
    for name in candidates:
        exe = shutil.which(name.split()[0]) if name else None
        if exe:
            return exe
    raise NativeBuildError(
        "gpupool's memory allocator compiles a small C library at first use, but no C compiler was "
        f"found (looked for {', '.join(c for c in candidates if c)}). Install one (e.g. `apt-get install "
        "gcc` or `build-essential`), or set CC to its path; or set GPUPOOL_CACHE_DIR to a directory "
        "that already holds a built libgpupool_alloc-*.so."
    )


def _source_key() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(CFLAGS + LDLIBS).encode())
    h.update(sys.implementation.cache_tag.encode())
    h.update(os.uname().machine.encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    """Builds the C core if needed and returns the path of the shared library.

    Raises:
        NativeBuildError: no compiler, or the compilation failed.
    """
    global _lib_path
    if _lib_path is not None:
        return _lib_path
    out_dir = cache_dir()
    target = out_dir / f"libgpupool_alloc-{_source_key()}.so"
    if not target.exists():
        compiler = find_compiler()
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise NativeBuildError(
                f"cannot create the build cache {out_dir}: {e}; set GPUPOOL_CACHE_DIR to a writable directory"
            ) from e
        # Build into a temporary file and rename it: concurrent processes never load a half-written library.
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [compiler, *CFLAGS, "-o", tmp, *(str(CSRC / s) for s in SOURCES), *LDLIBS]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            os.unlink(tmp)
            raise NativeBuildError(
                f"compiling gpupool's allocator failed ({' '.join(cmd)}):\n{proc.stderr.strip()}"
            )
        os.replace(tmp, target)
    _lib_path = target
    return target


def _declare(lib: ctypes.CDLL) -> None:
    c_int64, c_uint64, c_int, c_void_p = ctypes.c_int64, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p
    p_int64 = ctypes.POINTER(ctypes.c_int64)
    sigs: dict[str, tuple[object, list[object]]] = {
        "gp_create": (c_void_p, [c_int, c_int, c_int64, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
        "gp_destroy": (None, [c_void_p]),
        "gp_malloc": (c_int, [c_void_p, c_int64, c_uint64, ctypes.POINTER(c_uint64)]),
        "gp_malloc_ptr": (c_uint64, [c_void_p, c_int64, c_uint64]),
        "gp_last_rc": (c_int, []),
        "gp_free": (c_int, [c_void_p, c_uint64]),
        "gp_record_stream": (c_int, [c_void_p, c_uint64, c_uint64]),
        "gp_block_size": (c_int64, [c_void_p, c_uint64]),
        "gp_set_quota": (c_int64, [c_void_p, c_int64]),
        "gp_set_target": (c_int64, [c_void_p, c_int64]),
        "gp_trim": (c_int64, [c_void_p]),
        "gp_stream_synchronize": (c_int, [c_void_p, c_uint64]),
        "gp_synchronize": (c_int, [c_void_p]),
        "gp_stats": (None, [c_void_p, p_int64, c_int]),
        "gp_reset_peak_stats": (None, [c_void_p]),
        "gp_snapshot": (c_int64, [c_void_p, p_int64, c_int64]),
        "gp_last_error": (ctypes.c_char_p, [c_void_p]),
        "gp_round_size": (c_int64, [c_int64]),
        "gp_global_set": (c_int, [c_int, c_void_p]),
        "gp_global_get": (c_void_p, [c_int]),
        "gp_bench_replay": (
            c_int64,
            [c_void_p, p_int64, ctypes.POINTER(ctypes.c_int32), c_int64, c_int64, c_int64, c_int],
        ),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def load() -> ctypes.CDLL:
    """Builds (once per source version) and loads the C core.

    Returns:
        The loaded library with argument and result types declared.

    Raises:
        NativeBuildError: no compiler, the build failed, or the library cannot be loaded.
    """
    global _lib
    with _lock:
        if _lib is None:
            path = library_path()
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:
                raise NativeBuildError(
                    f"cannot load {path}: {e}; delete it (it is rebuilt at next use) or set GPUPOOL_CACHE_DIR"
                ) from e
            _declare(lib)
            _lib = lib
        return _lib


def round_size(size: int) -> int:
    """Returns the block size the allocator uses for a request (512-byte rounding, minimum 512)."""
    return int(load().gp_round_size(size))


def find_cudart() -> str:
    """Returns an explicit libcudart path if one is known, else ``""`` (dlopen's search is used).

    ``GPUPOOL_CUDART_PATH`` wins; otherwise the copy shipped in the ``nvidia-cuda-runtime``
    wheel that PyTorch depends on, so the allocator and torch share one runtime.
    """
    env = os.environ.get("GPUPOOL_CUDART_PATH")
    if env:
        return env
    for entry in sys.path:
        lib_dir = Path(entry) / "nvidia" / "cuda_runtime" / "lib"
        if lib_dir.is_dir():
            libs = sorted(lib_dir.glob("libcudart.so*"))
            if libs:
                return str(libs[-1])
    return ""
