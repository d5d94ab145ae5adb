"""The pool's policy configuration: one validated file, one set of defaults, for every entry point.

``gpupool coordinator --config FILE`` and ``gpupool simulate --config FILE`` read the same
TOML file; flags given on the command line override single fields (``--set FIELD=VALUE`` any
scheduler field). With no file, both run :data:`DEFAULT_SCHEDULER`: the best settings measured
in the simulator (``docs/simulation.md``), so what the docs report is what a deployment does.

File layout (every key optional; unknown tables or keys are errors that name them)::

    [scheduler]                      # SchedulerConfig fields (docs/scheduler.md, "Settings")
    overcommit_ratio = 1.5
    las_threshold_gpu_s = [1800, 18000, 180000]
    use_remaining = true
    min_runtime_s = 0

    [prices]                         # operator prices (USD per GPU-hour), as the JSON price file
    models = { "H100-80GB" = 2.10, "A100-40GB" = 0.95 }
    qos_factor = { shared = 0.5 }
    default_per_hour_usd = 1.0

Example:
    >>> cfg = load_policy_config(None, {"overcommit_ratio": 2.0})
    >>> (cfg.scheduler.overcommit_ratio, cfg.scheduler.las_threshold_gpu_s)
    (2.0, (1800.0, 18000.0, 180000.0))
"""

from __future__ import annotations

import difflib
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.scheduler.types import SchedulerConfig
from gpupool_sdk.telemetry.pricing import PriceTable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: The policy a deployment and the simulator run when nothing is configured: the best settings
#: measured (``docs/simulation.md``, "Default policy"). Against :class:`SchedulerConfig`'s own
#: field defaults (a neutral constructor for tests and embedding): shared memory overcommitted to
#: 1.5x physical (predicted peaks must still fit), least-attained-service queues cut at 0.5, 5
#: and 50 GPU-hours with preemption across queues (against 1 and 10 GPU-hours before: 11-15 %
#: lower average JCT on congested Philly- and Helios-derived runs, 1.6 % on the Pollux/Sia
#: workloads, +0.7 % on Alibaba gpushare pods; ``docs/simulation.md`` section 5), progress-aware
#: ranking (``use_remaining``), no aging
#: and no ``max_wait_s`` bypass (both undo LAS ordering under congestion), and no Tiresias
#: starvation promotion (``las_promote_after_factor`` 0: at 8 it raised the congested average JCT
#: 1.6x with 20x the preemptions, ``docs/simulation.md`` section 5a): a long job may wait while
#: shorter ones keep arriving; an operator who needs a bound on that wait sets the factor.
#: Bounds on a cycle's work (issue 14, ``docs/scheduler.md`` *Performance*): only the first 32
#: pending jobs in order are considered in full (the others are placed where they fit now, as
#: Slurm's backfill stops at ``bf_max_job_test``) and a blocked job keeps last cycle's reserved
#: GPUs while they are unchanged (the Kubernetes scheduler's nominated node); measured side by
#: side with both off: average JCT 2-5 % lower on sections 5a-5c, not higher anywhere.
#: Reservations (``reserve_after_s``) only after 6 hours of waiting: LAS preemption already keeps
#: long runners from blocking a big job, and a reservation after 10 minutes held GPUs idle for it so
#: often that the pool turned FIFO-like on a trace it was not tuned on (tiresias_60job on one
#: 8 x V100: average JCT 1,399 s at 600 s against 719 s at 21,600 s, Tiresias 917 s); measured side
#: by side with 600, 3,600, 7,200, 14,400 and 43,200 s and none, 21,600 s is the lowest average
#: JCT on section 5b and within 1 % of the lowest on 5a and 5c (``docs/scheduler.md``).
DEFAULT_SCHEDULER = SchedulerConfig(
    overcommit_ratio=1.5,
    aging_s_per_priority=0.0,
    max_wait_s=0.0,
    las_threshold_gpu_s=(1800.0, 18000.0, 180000.0),
    las_preempt=True,
    las_promote_after_factor=0.0,
    use_remaining=True,
    max_considered=32,
    keep_reservations=True,
    reserve_after_s=21600.0,
)

#: The top-level tables a policy file may hold.
TABLES = ("scheduler", "prices")


@dataclass(frozen=True)
class PolicyConfig:
    """The pool's policy: the scheduler's settings and the operator's prices.

    Attributes:
        scheduler: the scheduler's settings (validated by :class:`SchedulerConfig`).
        prices: the operator's price table (None: the catalog prices, or ``$GPUPOOL_PRICES``).
        source: where it came from (a file path, or ``"defaults"``).
        overridden: the scheduler fields set on the command line (shown by :meth:`describe`).
    """

    scheduler: SchedulerConfig = DEFAULT_SCHEDULER
    prices: PriceTable | None = None
    source: str = "defaults"
    overridden: tuple[str, ...] = ()

    def price_table(self) -> PriceTable:
        """The configured prices, else :meth:`PriceTable.load` (``$GPUPOOL_PRICES``, catalog)."""
        return self.prices if self.prices is not None else PriceTable.load()

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain data (what ``gpupool simulate -o json`` prints under ``config``)."""
        sched = {f.name: _plain(getattr(self.scheduler, f.name)) for f in fields(SchedulerConfig)}
        out: dict[str, Any] = {"source": self.source, "overridden": list(self.overridden), "scheduler": sched}
        if self.prices is not None:
            out["prices"] = self.prices.to_dict()
        return out

    def describe(self) -> str:
        """One line per scheduler field, TOML-like, marking those that differ from the defaults
        (``# default X``) and those set on the command line (``# flag``)."""
        lines = [f"# policy configuration: {self.source}", "[scheduler]"]
        for f in fields(SchedulerConfig):
            value = getattr(self.scheduler, f.name)
            note = ""
            if f.name in self.overridden:
                note = "  # flag"
            elif value != getattr(DEFAULT_SCHEDULER, f.name):
                note = f"  # default {_toml(getattr(DEFAULT_SCHEDULER, f.name))}"
            lines.append(f"{f.name} = {_toml(value)}{note}")
        if self.prices is not None:
            lines.append("[prices]")
            for model, price in sorted(self.prices.overrides.items()):
                lines.append(f'models."{model}" = {price:g}')
            for qos, factor in self.prices.qos_factor.items():
                lines.append(f"qos_factor.{qos.value} = {factor:g}")
            if self.prices.default_per_hour_usd is not None:
                lines.append(f"default_per_hour_usd = {self.prices.default_per_hour_usd:g}")
        return "\n".join(lines)


def load_policy_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    flag_names: Mapping[str, str] | None = None,
) -> PolicyConfig:
    """The policy configuration: :data:`DEFAULT_SCHEDULER`, then the file's ``[scheduler]``
    table, then ``overrides`` (scheduler field -> value, from command-line flags).

    Args:
        path: a TOML policy file (see the module docstring), or None for the defaults.
        overrides: scheduler fields set on the command line; they win over the file.
        flag_names: field -> the flag that set it, so that an error names the flag.

    Raises:
        ConfigError: unreadable file, invalid TOML, an unknown table or key, a wrong type or an
            out-of-range value; the field is ``FILE: scheduler.KEY`` (or the flag) and the
            message says what is accepted.
    """
    values: dict[str, Any] = {}
    prices: PriceTable | None = None
    source = "defaults"
    if path is not None:
        p = Path(path)
        source = str(p)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError("--config", f"cannot read policy file {source!r} ({exc.strerror}); fix the path") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(source, f"not valid TOML ({exc}); see docs/scheduler.md, 'Policy file'") from None
        for table in data:
            if table not in TABLES:
                raise ConfigError(
                    f"{source}: {table}",
                    f"unknown table or top-level key; a policy file has [{'], ['.join(TABLES)}]"
                    + _suggest(table, TABLES),
                )
        raw = data.get("scheduler", {})
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: scheduler", "must be a table ([scheduler] followed by KEY = VALUE lines)")
        for key, value in raw.items():
            values[key] = coerce_field(key, value, f"{source}: scheduler.{key}")
        if "prices" in data:
            prices = PriceTable.from_dict(data["prices"], where=f"{source}: prices")
    names = dict(flag_names or {})
    for key, value in (overrides or {}).items():
        values[key] = coerce_field(key, value, names.get(key, key))
    try:
        scheduler = replace(DEFAULT_SCHEDULER, **values)
    except ConfigError as exc:
        where = names.get(exc.field) if exc.field in (overrides or {}) else f"{source}: scheduler.{exc.field}"
        raise ConfigError(where or exc.field, str(exc).split(": ", 1)[-1]) from None
    return PolicyConfig(scheduler=scheduler, prices=prices, source=source, overridden=tuple(sorted(overrides or {})))


def coerce_field(key: str, value: Any, where: str) -> Any:
    """Check ``value`` against the type of :class:`SchedulerConfig` field ``key``.

    Raises:
        ConfigError: unknown field (with the closest known name) or a value of the wrong type.
    """
    known = {f.name: f for f in fields(SchedulerConfig)}
    if key not in known:
        raise ConfigError(where, "unknown scheduler setting" + _suggest(key, known) + "; see docs/scheduler.md, 'Settings'")
    kind = str(known[key].type)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(where, f"must be true or false, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(where, f"must be an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(where, f"must be a number, got {value!r}")
        return float(value)
    if kind.startswith("tuple"):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) for v in value
        ):
            raise ConfigError(where, f"must be a list of numbers, e.g. [3600, 36000] ([] = off), got {value!r}")
        return tuple(float(v) for v in value)
    return value  # pragma: no cover - every field has one of the types above


def parse_assignment(text: str) -> tuple[str, Any]:
    """Parse ``FIELD=VALUE`` (``--set``); VALUE is a TOML value (``true``, ``1.5``, ``[3600, 36000]``).

    Raises:
        ConfigError: no ``=``, or a value that is not TOML (the message shows the form).

    Example:
        >>> parse_assignment("las_threshold_gpu_s=[3600, 36000]")
        ('las_threshold_gpu_s', [3600, 36000])
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError("--set", f"expected FIELD=VALUE (e.g. use_remaining=false), got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(
            f"--set {key}", f"{raw.strip()!r} is not a TOML value (true, 1.5, 600, [3600, 36000])"
        ) from None
    return key, value


def _suggest(name: str, options: Any) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float) and math.isinf(value):
        return str(value)
    return value


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(f"{v:g}" for v in value) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


__all__ = [
    "DEFAULT_SCHEDULER",
    "PolicyConfig",
    "coerce_field",
    "load_policy_config",
    "parse_assignment",
]
