"""GPU prices for cost accounting: the catalog's list prices, overridden by the operator.

Resolution order for a model's price per GPU-hour (USD):

1. the operator's override file (``GPUPOOL_PRICES=/path/prices.json`` or ``--prices``),
2. the catalog's inline overrides ``GPUPOOL_GPU_PRICES="H100-80GB=2.5,A100=1.2"``,
3. ``gpupool_sdk.inventory.catalog``: the model's ``price_per_hour_usd`` list price,
4. the override file's ``default_per_hour_usd`` (else the model is *unpriced*: cost 0, reported).

Override file (JSON)::

    {
      "models": {"H100-80GB": 2.10, "A100-40GB": 0.95},
      "qos_factor": {"shared": 0.5},
      "default_per_hour_usd": 1.0
    }

``qos_factor`` multiplies the price by QoS class. The defaults are ``exclusive`` 1.0,
``guaranteed`` 1.0 and ``shared`` :data:`SHARED_QOS_FACTOR` (0.5): shared slices are the pool's
spot-like class (preempted first, may be overcommitted), so they are charged half.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpupool_sdk.errors import ConfigError, GpupoolError
from gpupool_sdk.resources import QoS

PRICES_ENV = "GPUPOOL_PRICES"
#: The inventory catalog's inline overrides (``"H100-80GB=2.5,A100=1.2"``), below the JSON file.
CATALOG_PRICES_ENV = "GPUPOOL_GPU_PRICES"

#: Price multiplier of the ``shared`` QoS class (the pool's spot-like, preemptible class).
SHARED_QOS_FACTOR = 0.5

DEFAULT_QOS_FACTOR: Mapping[QoS, float] = {
    QoS.EXCLUSIVE: 1.0,
    QoS.GUARANTEED: 1.0,
    QoS.SHARED: SHARED_QOS_FACTOR,
}


@dataclass(frozen=True)
class ModelOffer:
    """A GPU model as the advice rules see it: memory, list price per GPU-hour, features, compute.

    ``tflops`` is :func:`reference_tflops` of the model (0 when unknown: compute is then not checked).
    """

    name: str
    memory_bytes: int
    price_per_hour_usd: float
    features: frozenset[str] = frozenset()
    tflops: float = 0.0


def reference_tflops(tflops: Mapping[str, float]) -> float:
    """One number to compare GPUs' training compute: dense 16-bit tensor TFLOPS (else fp32); 0 if unknown."""
    return float(max(tflops.get("bf16", 0.0), tflops.get("fp16", 0.0)) or tflops.get("fp32", 0.0) or 0.0)


def _catalog_price(model: str) -> float | None:
    """The catalog's list price of ``model`` (no operator override), or None when unknown."""
    try:
        from gpupool_sdk.inventory.catalog import price_per_hour
    except ImportError:
        return None
    return price_per_hour(model, overrides={})


def canonical_model(model: str) -> str:
    """The catalog's canonical name of ``model`` (``"h100"`` -> ``"H100-80GB"``), else ``model``."""
    try:
        from gpupool_sdk.inventory.catalog import lookup_model
    except ImportError:
        return model
    try:
        return lookup_model(model).name
    except GpupoolError:
        return model


def catalog_offers() -> tuple[ModelOffer, ...]:
    """Every catalog model with its list price, cheapest first (for the "cheaper model fits" advice)."""
    try:
        from gpupool_sdk.inventory.catalog import CATALOG
    except ImportError:
        return ()
    offers = [
        ModelOffer(
            m.name, m.memory_bytes, float(m.price_per_hour_usd), frozenset(m.features), reference_tflops(m.tflops)
        )
        for m in CATALOG.values()
    ]
    return tuple(sorted(offers, key=lambda o: (o.price_per_hour_usd, o.memory_bytes)))


@dataclass(frozen=True)
class PriceTable:
    """Prices per GPU-hour by model plus the QoS multipliers.

    Args:
        overrides: operator prices by model name (USD per GPU-hour); win over the catalog.
        qos_factor: price multiplier by QoS class (defaults: exclusive 1, guaranteed 1, shared 0.5).
        default_per_hour_usd: price of a model neither overridden nor in the catalog; None
            leaves it unpriced (cost 0).
        catalog: looks up a model's list price; defaults to the inventory catalog. Tests pass a
            plain function.

    Example:
        >>> t = PriceTable(overrides={"H100-80GB": 2.0}, catalog=lambda m: None)
        >>> t.price_per_hour("H100-80GB", "shared")
        1.0
    """

    overrides: Mapping[str, float] = field(default_factory=dict)
    qos_factor: Mapping[QoS, float] = field(default_factory=lambda: dict(DEFAULT_QOS_FACTOR))
    default_per_hour_usd: float | None = None
    catalog: Callable[[str], float | None] = _catalog_price

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "overrides",
            {canonical_model(m): _check_price(price, f"models.{m}") for m, price in self.overrides.items()},
        )
        factors = dict(DEFAULT_QOS_FACTOR)
        for q, f in self.qos_factor.items():
            try:
                qos = QoS(q)
            except ValueError:
                raise ConfigError(
                    f"qos_factor.{q}", f"unknown QoS class; use one of {[c.value for c in QoS]}"
                ) from None
            factors[qos] = _check_price(f, f"qos_factor.{qos.value}")
        object.__setattr__(self, "qos_factor", factors)
        if self.default_per_hour_usd is not None:
            _check_price(self.default_per_hour_usd, "default_per_hour_usd")

    def base_price(self, model: str) -> float | None:
        """USD per GPU-hour of ``model`` before the QoS factor; None when unpriced."""
        if model in self.overrides:
            return float(self.overrides[model])
        canonical = canonical_model(model)
        if canonical in self.overrides:
            return float(self.overrides[canonical])
        price = self.catalog(model)
        if price is not None:
            return price
        return self.default_per_hour_usd

    def factor(self, qos: QoS | str) -> float:
        """The price multiplier of a QoS class."""
        return self.qos_factor[QoS(qos)]

    def price_per_hour(self, model: str, qos: QoS | str = QoS.GUARANTEED) -> float | None:
        """USD per GPU-hour of a whole ``model`` GPU under ``qos``; None when unpriced."""
        base = self.base_price(model)
        return None if base is None else base * self.factor(qos)

    def to_dict(self) -> dict[str, Any]:
        """The table as the price file's JSON object (the operator's part; catalog prices are not copied).

        Example:
            >>> t = PriceTable(overrides={"H100-80GB": 2.0}, catalog=lambda m: None)
            >>> PriceTable.from_dict(t.to_dict()).price_per_hour("H100-80GB", "shared")
            1.0
        """
        return {
            "models": dict(self.overrides),
            "qos_factor": {QoS(q).value: f for q, f in self.qos_factor.items()},
            "default_per_hour_usd": self.default_per_hour_usd,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "prices") -> PriceTable:
        """Build a table from the override file's JSON object (see the module docstring)."""
        if not isinstance(d, Mapping):
            raise ConfigError(where, "expected a JSON object with 'models', 'qos_factor', 'default_per_hour_usd'")
        unknown = set(d) - {"models", "qos_factor", "default_per_hour_usd"}
        if unknown:
            raise ConfigError(
                f"{where}.{sorted(unknown)[0]}",
                "unknown field; the file has 'models' (USD per GPU-hour by model), 'qos_factor', 'default_per_hour_usd'",
            )
        models = d.get("models") or {}
        factors = d.get("qos_factor") or {}
        for name, value in (("models", models), ("qos_factor", factors)):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}.{name}", f"expected an object of name -> number, got {value!r}")
        default = d.get("default_per_hour_usd")
        return cls(
            overrides={str(k): _check_price(v, f"{where}.models.{k}") for k, v in models.items()},
            qos_factor={str(k): _check_price(v, f"{where}.qos_factor.{k}") for k, v in factors.items()},  # type: ignore[misc]
            default_per_hour_usd=None if default is None else _check_price(default, f"{where}.default_per_hour_usd"),
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> PriceTable:
        """The price table: ``path``, else ``$GPUPOOL_PRICES``, else catalog prices only.

        Raises:
            ConfigError: the file is missing or malformed; the message names the file and field.
        """
        env = os.environ if env is None else env
        inline = _inline_overrides(env.get(CATALOG_PRICES_ENV))
        field_name = "--prices" if path is not None else PRICES_ENV
        src = path if path is not None else env.get(PRICES_ENV) or None
        if src is None:
            return cls(overrides=inline)
        p = Path(src)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(field_name, f"cannot read price file {str(p)!r} ({exc.strerror}); fix the path") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(field_name, f"{str(p)!r} is not valid JSON ({exc})") from None
        table = cls.from_dict(data, where=str(p))
        return replace(table, overrides={**inline, **table.overrides}) if inline else table


def _inline_overrides(text: str | None) -> dict[str, float]:
    if not text:
        return {}
    from gpupool_sdk.inventory.catalog import parse_price_overrides

    return parse_price_overrides(text)


def _check_price(value: Any, fieldname: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ConfigError(fieldname, f"must be a number >= 0 (USD per GPU-hour or a multiplier), got {value!r}")
    return float(value)
