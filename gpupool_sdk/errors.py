"""Typed errors of gpupool-sdk.

Every error the SDK raises derives from :class:`GpupoolError`. Messages name the argument,
field or environment variable at fault and say how to fix it.
"""

from __future__ import annotations


class GpupoolError(Exception):
    """Root of every error raised by gpupool-sdk."""


class ConfigError(GpupoolError, ValueError):
    """A setting, argument or environment variable is invalid.

    Args:
        field: the name of the argument, field or variable at fault.
        message: what is wrong and how to fix it.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class SpecError(ConfigError):
    """A job spec, size or simulated-GPU declaration is malformed."""


class UnknownGpuModelError(SpecError):
    """A GPU model name is not in the catalog; the message lists the known ones."""


class SchemaError(GpupoolError):
    """A value read from etcd is not valid JSON of the expected schema (for example hand-edited)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


class StoreError(GpupoolError):
    """An etcd operation failed."""


class StoreUnavailableError(StoreError):
    """etcd cannot be reached (connection refused, timeout, no leader)."""


class StoreTLSError(StoreUnavailableError):
    """The TLS handshake with etcd failed: the server's certificate is not trusted by the CA given,
    etcd refused the client certificate (or required one), the certificate does not name the host,
    or one side speaks TLS and the other plaintext. Retrying does not help; the message says what to fix."""


class StoreAuthError(StoreError):
    """etcd refused the credentials (wrong user or password, or none given while auth is enabled),
    or the user lacks permission on the pool's keys; the message names the setting to fix."""


class LeaseLostError(StoreError):
    """The etcd lease expired or was revoked: everything attached to it is gone."""


class TxnTooLargeError(StoreError):
    """etcd refused a transaction with more operations than its ``--max-txn-ops`` allows."""


class CompactedError(StoreError):
    """A watch asked for a revision that etcd has compacted away."""

    def __init__(self, revision: int, compact_revision: int) -> None:
        self.revision = revision
        self.compact_revision = compact_revision
        super().__init__(
            f"revision {revision} is compacted (oldest available {compact_revision}); re-read and resume"
        )


class EtcdNotFoundError(GpupoolError):
    """No etcd binary was found for the embedded launcher."""


class NodeClaimedError(GpupoolError):
    """Another live agent publishes the node name this agent was given (two agents, one ``--node``)."""


class NotLeaderError(GpupoolError):
    """A coordinator write was fenced out because this replica no longer leads."""


class AcquireTimeoutError(GpupoolError, TimeoutError):
    """The pool did not grant the job within the requested timeout."""


class JobRejectedError(GpupoolError):
    """The coordinator rejected the job spec as impossible; the reason says why."""


class PreemptedError(GpupoolError):
    """The job was preempted by the pool (it checkpointed and released its slices)."""
