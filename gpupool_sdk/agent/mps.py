"""CUDA MPS for the node agent: run (or use) the MPS control daemon and publish it on the GPUs.

Where MPS is available (``nvidia-cuda-mps-control`` on the PATH, real GPUs), the agent runs one
control daemon for the node with its own pipe and log directories, and publishes the pipe
directory in every GPU's record (``mps_pipe_dir``). A job on such a GPU gets
``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (its compute share) and
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (its memory quota) from its grant
(:func:`gpupool_sdk.client.mps.mps_environment`), so the GPU enforces the shares; ``gpupool
status`` shows ``mps`` as the GPU's sharing mechanism. An operator who runs the daemon another way
passes its pipe directory (``gpupool agent --mps-pipe-dir DIR``): the agent publishes it and
neither starts nor stops anything.

One daemon per node rather than per GPU: a CUDA process connects to one MPS control daemon (one
pipe directory), and a multi-GPU job must reach all its GPUs through it.

The daemon is stopped (``quit`` on its control pipe) when the agent stops cleanly; an agent
killed with SIGKILL leaves it running, and the next agent start adopts it (same directories).
MIG instances are published without ``mps_pipe_dir`` (a MIG instance is already isolated).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.inventory.base import InventoryBackend
from gpupool_sdk.resources.gpu import GpuInfo, GpuReadings, NodeInfo

log = logging.getLogger(__name__)

CONTROL_BINARY = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"


class MpsDaemon:
    """One MPS control daemon with its own pipe and log directories.

    Args:
        base_dir: where ``pipe/`` and ``log/`` are made (e.g. ``/run/gpupool-mps/NODE``).
        binary: the control program (default: ``nvidia-cuda-mps-control`` on the PATH).
        env: environment for the daemon (default: this process's).
    """

    def __init__(self, base_dir: str | os.PathLike[str], binary: str | None = None, env: dict[str, str] | None = None) -> None:
        self.base = Path(base_dir)
        self.pipe_dir = self.base / "pipe"
        self.log_dir = self.base / "log"
        found = binary or shutil.which(CONTROL_BINARY)
        if found is None:
            raise ConfigError("mps", f"{CONTROL_BINARY} is not on the PATH; install the NVIDIA driver utilities or use --mps off")
        self.binary = found
        self._env = dict(os.environ if env is None else env)
        self.started = False

    @property
    def env(self) -> dict[str, str]:
        """The daemon's (and its clients') MPS variables added to the base environment."""
        return {**self._env, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def running(self) -> bool:
        """True when a daemon with these directories is alive (its pid file names a live process)."""
        try:
            pid = int((self.pipe_dir / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the daemon (``-d``), or adopt one already running on these directories.

        Raises:
            ConfigError: it did not start; the message has its output.
        """
        if self.running():
            log.info("MPS control daemon already running on %s; using it", self.pipe_dir)
            return
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Output to a file, not a pipe: the daemon's child may keep inherited descriptors open.
        start_log = self.log_dir / "gpupool-start.log"
        with start_log.open("w") as out_f:
            rc = subprocess.run(
                [self.binary, "-d"], env=self.env, stdin=subprocess.DEVNULL, stdout=out_f, stderr=subprocess.STDOUT,
                timeout=timeout_s,
            ).returncode
        if rc != 0:
            raise ConfigError("mps", f"{self.binary} -d failed ({rc}): {start_log.read_text().strip()}")
        self.started = True
        log.info("started the MPS control daemon (pipe %s)", self.pipe_dir)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the daemon to quit (only one this object started)."""
        if not self.started:
            return
        try:
            subprocess.run(
                [self.binary], input="quit\n", env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                text=True, timeout=timeout_s,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("could not stop the MPS control daemon: %s", e)
        self.started = False


class MpsBackend:
    """An inventory backend whose whole GPUs carry the MPS pipe directory (``mps_pipe_dir``).

    Args:
        inner: the real backend (NVML).
        pipe_dir: the control daemon's pipe directory.
        daemon: the daemon this agent runs (stopped with the backend), or None when it is run by others.
    """

    def __init__(self, inner: InventoryBackend, pipe_dir: str, daemon: MpsDaemon | None = None) -> None:
        self.inner = inner
        self.pipe_dir = pipe_dir
        self.daemon = daemon
        self.kind = getattr(inner, "kind", "nvml")

    @property
    def node(self) -> str:
        return self.inner.node

    def node_info(self) -> NodeInfo:
        return self.inner.node_info()

    def gpus(self) -> list[GpuInfo]:
        return [g if g.is_mig else dataclasses.replace(g, mps_pipe_dir=self.pipe_dir) for g in self.inner.gpus()]

    def readings(self) -> Mapping[str, GpuReadings]:
        return self.inner.readings()

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            if self.daemon is not None:
                self.daemon.stop()


def with_mps(backend: InventoryBackend, mode: str, base_dir: str | None = None, pipe_dir: str | None = None) -> InventoryBackend:
    """Wrap ``backend`` for ``gpupool agent --mps MODE``.

    Args:
        backend: the node's inventory backend.
        mode: ``off`` (no MPS), ``on`` (run the daemon; fail when it cannot run), ``auto`` (run it
            when the control program is installed and the GPUs are real, else go on without).
        base_dir: the daemon's directories (default ``$XDG_RUNTIME_DIR`` or ``/tmp``, then
            ``gpupool-mps/{node}``).
        pipe_dir: an MPS daemon run by someone else: publish its pipe directory, start nothing.

    Raises:
        ConfigError: ``on`` and the daemon cannot run; or an unknown mode.
    """
    if mode not in ("off", "on", "auto"):
        raise ConfigError("mps", f"{mode!r} is not a mode; use off, on or auto")
    if pipe_dir is not None:
        return MpsBackend(backend, pipe_dir)
    if mode == "off" or (mode == "auto" and (getattr(backend, "kind", "") != "nvml" or shutil.which(CONTROL_BINARY) is None)):
        return backend
    root = base_dir or os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", "gpupool-mps", backend.node)
    try:
        daemon = MpsDaemon(root)
        daemon.start()
    except (ConfigError, OSError, subprocess.TimeoutExpired) as e:
        if mode == "on":
            raise ConfigError("mps", f"cannot run the MPS control daemon: {e}") from None
        log.warning("MPS not available (%s); jobs sharing a GPU use time-slicing instead", e)
        return backend
    return MpsBackend(backend, str(daemon.pipe_dir), daemon)
