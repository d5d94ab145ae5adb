"""Timing settings with validated relations between them.

The rule that keeps lease holders safe (from Patroni): a holder refreshes every
``keepalive_interval_s``; one refresh may take up to ``retry_timeout_s`` of retries; and it must
be able to miss one refresh and still retry once more before the TTL runs out:

    keepalive_interval_s + 2 * retry_timeout_s <= ttl_s

A holder that has had no successful refresh for ``ttl_s - keepalive_interval_s`` steps down
(declares its lease lost) before etcd can expire it, so it never believes it holds what it lost.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from gpupool_sdk.errors import ConfigError

LEASE_TTL_ENV = "GPUPOOL_LEASE_TTL"
KEEPALIVE_ENV = "GPUPOOL_KEEPALIVE_INTERVAL"
RETRY_TIMEOUT_ENV = "GPUPOOL_RETRY_TIMEOUT"


@dataclass(frozen=True)
class LeaseTiming:
    """TTL, keepalive interval and retry deadline of an etcd lease holder.

    Args:
        ttl_s: lease time-to-live. etcd leases are whole seconds: rounded up, at least 2.
        keepalive_interval_s: time between two refreshes.
        retry_timeout_s: how long one refresh may retry a failing etcd before giving up.

    Raises:
        ConfigError: a value is not positive, the TTL is under 2 s, or
            ``keepalive_interval_s + 2 * retry_timeout_s > ttl_s``; the message names the fields.

    Example:
        >>> LeaseTiming(ttl_s=10, keepalive_interval_s=2, retry_timeout_s=3).step_down_after_s
        8.0
    """

    ttl_s: float = 10.0
    keepalive_interval_s: float = 2.0
    retry_timeout_s: float = 3.0

    def __post_init__(self) -> None:
        for name in ("ttl_s", "keepalive_interval_s", "retry_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(name, f"must be a number of seconds, got {value!r}")
            if value <= 0:
                raise ConfigError(name, f"must be > 0 seconds, got {value}")
            object.__setattr__(self, name, float(value))
        ttl = float(math.ceil(self.ttl_s))
        if ttl < 2:
            raise ConfigError("ttl_s", f"must be at least 2 seconds (etcd leases are whole seconds), got {self.ttl_s}")
        object.__setattr__(self, "ttl_s", ttl)
        need = self.keepalive_interval_s + 2 * self.retry_timeout_s
        if need > self.ttl_s:
            raise ConfigError(
                "ttl_s",
                f"keepalive_interval_s + 2 * retry_timeout_s = {self.keepalive_interval_s:g} + 2 * "
                f"{self.retry_timeout_s:g} = {need:g} exceeds ttl_s = {self.ttl_s:g}; raise ttl_s to at least "
                f"{math.ceil(need)} or lower keepalive_interval_s / retry_timeout_s",
            )

    @property
    def ttl_whole_s(self) -> int:
        """The TTL as etcd grants it (whole seconds)."""
        return int(self.ttl_s)

    @property
    def step_down_after_s(self) -> float:
        """With no successful refresh for this long, the holder declares its lease lost."""
        return self.ttl_s - self.keepalive_interval_s

    @classmethod
    def from_env(cls) -> LeaseTiming:
        """Defaults overridden by ``GPUPOOL_LEASE_TTL``, ``GPUPOOL_KEEPALIVE_INTERVAL``, ``GPUPOOL_RETRY_TIMEOUT``."""
        kwargs: dict[str, float] = {}
        for env, name in ((LEASE_TTL_ENV, "ttl_s"), (KEEPALIVE_ENV, "keepalive_interval_s"), (RETRY_TIMEOUT_ENV, "retry_timeout_s")):
            raw = os.environ.get(env)
            if raw is None or raw == "":
                continue
            try:
                kwargs[name] = float(raw)
            except ValueError:
                raise ConfigError(env, f"{raw!r} is not a number of seconds; set e.g. {env}=10") from None
        return cls(**kwargs)
