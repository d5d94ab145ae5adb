"""Messages between the training process and its I/O helper, and typed errors across the pipe.

Training process -> helper (``request``; each carries an ``id`` answered by one ``reply``)::

    {"op": "acquire", "id", "spec": JobSpec, "timeout": float | None}
    {"op": "ack", "id", "job", "ack": Ack}
    {"op": "release", "id", "job"}
    {"op": "resume_info", "id", "job"}
    {"op": "telemetry", "job", "record": TelemetryRecord}          (no reply)
    {"op": "close"}                                               (no reply; the helper exits)

Helper -> training process::

    {"op": "reply", "id", "result": Any, "error": (class name, message) | None}
    {"op": "state", "job", "lease_id", "status": JobStatus | None, "allocations": tuple[Allocation, ...]}
    {"op": "directive", "job", "directive": Directive}
    {"op": "lost", "job", "lease_id": int (absent for a gang member), "error": (class name, message)}

Every message is a plain dict of picklable values (the records are frozen dataclasses).
"""

from __future__ import annotations

from typing import Any

from gpupool_sdk import errors as _errors
from gpupool_sdk.errors import GpupoolError


class JobAlreadyRunningError(GpupoolError):
    """A live job of the same name holds ``jobs/{job}/spec``; the message names its etcd lease."""


class HelperDiedError(GpupoolError):
    """The client's I/O helper process exited; nothing keeps the job's lease alive any more."""


def _error_classes() -> dict[str, type[BaseException]]:
    out: dict[str, type[BaseException]] = {
        name: obj
        for name, obj in vars(_errors).items()
        if isinstance(obj, type) and issubclass(obj, GpupoolError)
    }
    out["JobAlreadyRunningError"] = JobAlreadyRunningError
    out["HelperDiedError"] = HelperDiedError
    return out


def pack_error(exc: BaseException) -> tuple[str, str]:
    """An exception as (class name, message), safe to send over the pipe."""
    name = type(exc).__name__ if isinstance(exc, GpupoolError) else "GpupoolError"
    msg = str(exc) if isinstance(exc, GpupoolError) else f"{type(exc).__name__}: {exc}"
    return name, msg


def unpack_error(packed: tuple[str, str]) -> GpupoolError:
    """Rebuild the typed error (same class, same message) without calling its ``__init__``."""
    name, msg = packed
    cls = _error_classes().get(name, GpupoolError)
    exc = cls.__new__(cls)
    Exception.__init__(exc, msg)
    return exc  # type: ignore[return-value]


def request(op: str, **fields: Any) -> dict[str, Any]:
    return {"op": op, **fields}
