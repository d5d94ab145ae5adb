"""Checkpoint and resume bookkeeping of one job: where checkpoints go, which one to resume from.

Rules (docs/lightning.md, "Resume"):

* The pool's checkpoints are ``{dir}/{job}-{tag}-step{N}.ckpt`` with ``tag`` one of ``preempt``
  (a preempt directive), ``signal`` (SIGTERM/SIGINT/SIGUSR1) and ``emergency`` (lease lost).
  Each is written to a temporary name and renamed into place, so a crash never leaves a
  half-written file under a name that looks valid.
* The resume point is the newest *readable* checkpoint among the pool's, the one the pool
  recorded in etcd, ``last*.ckpt`` in the directory or in ``{dir}/{job}/`` (Lightning's
  ``ModelCheckpoint(dirpath=..., save_last=True)``) and the user's ``resume_paths``. A file that is truncated or not a checkpoint is skipped with
  a warning that names it.
* A run that finishes writes ``{dir}/{job}.finished``; checkpoints older than it are from a
  finished run and never resumed, so a new run under the same name starts fresh.
* Only the newest ``keep`` pool checkpoints of the job are kept.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import time
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger("gpupool_sdk.runtime")

#: Tags of the pool's own checkpoints.
TAGS = ("preempt", "signal", "emergency")


def checkpoint_readable(path: str | os.PathLike[str]) -> tuple[bool, str]:
    """Whether ``path`` is a complete checkpoint file, cheaply (no tensor is loaded).

    ``torch.save`` (and so Lightning's ``save_checkpoint``) writes a zip archive whose directory
    sits at the end of the file: a truncated file has none. Older pickle-format files (not zip)
    are accepted when non-empty.

    Returns:
        ``(ok, why_not)``.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
    except OSError as exc:
        return False, f"cannot be read ({exc.strerror or exc})"
    if size == 0:
        return False, "is empty"
    try:
        with open(p, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        return False, f"cannot be read ({exc.strerror or exc})"
    if magic[:2] != b"PK":
        return (True, "") if magic[:1] == b"\x80" else (False, "is not a checkpoint (neither zip nor pickle)")
    try:
        with zipfile.ZipFile(p) as zf:
            if not zf.namelist():
                return False, "is an empty archive"
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        return False, f"is truncated or corrupt ({exc})"
    return True, ""


class CheckpointBook:
    """Where a job's checkpoints go and which one it resumes from.

    Args:
        directory: the checkpoint directory (shared by every rank).
        job: the job name.
        keep: how many pool checkpoints of the job to keep.
        extra_patterns: glob patterns of more resume candidates.
        readable: the validity test (default :func:`checkpoint_readable`).
    """

    def __init__(self, directory: Path, job: str, keep: int = 2, extra_patterns: Iterable[str] = (),
                 readable: Callable[[str], tuple[bool, str]] = checkpoint_readable) -> None:
        self.directory = Path(directory)
        self.job = job
        self.keep = keep
        self.extra_patterns = tuple(extra_patterns)
        self.readable = readable
        self._warned: set[str] = set()
        self._pattern = re.compile(rf"^{re.escape(job)}-({'|'.join(TAGS)})-step(\d+)\.ckpt$")

    # -- writing ------------------------------------------------------------------------------
    def path(self, step: int, tag: str) -> Path:
        """The final path of the pool checkpoint ``tag`` at ``step`` (the directory is created)."""
        if tag not in TAGS:
            raise ValueError(f"unknown checkpoint tag {tag!r}")
        self.directory.mkdir(parents=True, exist_ok=True)
        return self.directory / f"{self.job}-{tag}-step{step}.ckpt"

    def write(self, step: int, tag: str, save: Callable[[str], None], writer: bool = True) -> str:
        """Write a checkpoint through ``save(path)`` atomically; prune old ones; return the final path.

        Every rank calls ``save`` (a framework's save is often a collective in which one rank
        writes); only the ``writer`` (rank 0) renames the file into place and prunes.
        """
        final = self.path(step, tag)
        tmp = final.with_name(f".{final.name}.tmp")
        save(str(tmp))
        if writer:
            try:
                os.replace(tmp, final)
            finally:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            self.prune()
        return str(final)

    def own(self) -> list[Path]:
        """The job's pool checkpoints, newest first (by modification time, then step)."""
        if not self.directory.is_dir():
            return []
        found: list[tuple[float, int, Path]] = []
        for p in self.directory.iterdir():
            m = self._pattern.match(p.name)
            if m:
                with contextlib.suppress(OSError):
                    found.append((p.stat().st_mtime, int(m.group(2)), p))
        found.sort(key=lambda t: (t[0], t[1]), reverse=True)
        return [p for _, _, p in found]

    def prune(self) -> list[Path]:
        """Delete all but the newest :attr:`keep` pool checkpoints of the job; return the deleted."""
        gone = self.own()[self.keep:]
        for p in gone:
            with contextlib.suppress(OSError):
                p.unlink()
        return gone

    # -- finishing ----------------------------------------------------------------------------
    @property
    def finished_marker(self) -> Path:
        return self.directory / f"{self.job}.finished"

    def mark_finished(self, step: int) -> None:
        """Record that the job's run finished: its checkpoints are no longer resume points."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.finished_marker.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps({"job": self.job, "step": step, "finished_at": time.time()}))
            os.replace(tmp, self.finished_marker)
        except OSError as exc:
            log.warning("gpupool: could not record that %s finished (%s); a new run under this name may "
                        "resume from its last checkpoint", self.job, exc)

    def _finished_at(self) -> float:
        try:
            return self.finished_marker.stat().st_mtime
        except OSError:
            return 0.0

    # -- choosing -----------------------------------------------------------------------------
    def candidates(self, recorded: str | None = None) -> list[Path]:
        """Every resume candidate that exists (not yet checked for readability)."""
        paths: list[Path] = list(self.own())
        if recorded:
            paths.append(Path(recorded))
        if self.directory.is_dir():
            paths.extend(sorted(self.directory.glob("last*.ckpt")))
            paths.extend(sorted((self.directory / self.job).glob("last*.ckpt")))
        for pattern in self.extra_patterns:
            paths.extend(Path(p) for p in glob.glob(os.path.expanduser(pattern)))
        seen: set[str] = set()
        out = []
        for p in paths:
            key = os.path.abspath(p)
            if key not in seen and p.is_file():
                seen.add(key)
                out.append(p)
        return out

    def resume_point(self, recorded: str | None = None) -> str | None:
        """The newest readable candidate written after the last finished run, or None."""
        finished = self._finished_at()
        dated: list[tuple[float, Path]] = []
        for p in self.candidates(recorded):
            with contextlib.suppress(OSError):
                dated.append((p.stat().st_mtime, p))
        dated.sort(key=lambda t: t[0], reverse=True)
        for mtime, p in dated:
            if mtime <= finished:
                break
            ok, why = self.readable(str(p))
            if ok:
                return str(p)
            if str(p) not in self._warned:
                self._warned.add(str(p))
                log.warning("gpupool: skipping checkpoint %s for %s: it %s", p, self.job, why)
        return None
