"""PriceTable: catalog prices, operator overrides, QoS factors (pure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.inventory.catalog import CATALOG
from gpupool_sdk.telemetry.pricing import SHARED_QOS_FACTOR, PriceTable, catalog_offers


def _write(tmp_path: Path, body: object) -> Path:
    p = tmp_path / "prices.json"
    p.write_text(json.dumps(body))
    return p


def test_catalog_price_without_overrides() -> None:
    t = PriceTable.load(env={})
    assert t.price_per_hour("H100-80GB") == CATALOG["H100-80GB"].price_per_hour_usd
    assert t.price_per_hour("h100") == CATALOG["H100-80GB"].price_per_hour_usd  # alias
    assert t.price_per_hour("H100-80GB", "shared") == pytest.approx(
        CATALOG["H100-80GB"].price_per_hour_usd * SHARED_QOS_FACTOR
    )
    assert t.price_per_hour("no-such-gpu") is None


def test_file_beats_inline_env_beats_catalog(tmp_path: Path) -> None:
    path = _write(tmp_path, {"models": {"H100-80GB": 1.0}, "qos_factor": {"shared": 0.25}, "default_per_hour_usd": 0.1})
    env = {"GPUPOOL_PRICES": str(path), "GPUPOOL_GPU_PRICES": "H100-80GB=9,A100-40GB=0.5"}
    t = PriceTable.load(env=env)
    assert t.price_per_hour("H100-80GB") == 1.0  # file
    assert t.price_per_hour("A100-40GB") == 0.5  # inline env
    assert t.price_per_hour("T4-16GB") == CATALOG["T4-16GB"].price_per_hour_usd  # catalog
    assert t.price_per_hour("homebrew-gpu") == 0.1  # default
    assert t.price_per_hour("H100-80GB", "shared") == 0.25
    assert t.factor("exclusive") == 1.0


def test_explicit_path_wins_over_env(tmp_path: Path) -> None:
    path = _write(tmp_path, {"models": {"h100": 2.0}})  # aliases are canonicalised
    assert PriceTable.load(path, env={"GPUPOOL_PRICES": "/nonexistent.json"}).price_per_hour("H100-80GB") == 2.0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"models": {"H100-80GB": -1}}, "models.H100-80GB"),
        ({"models": {"H100-80GB": "cheap"}}, "models.H100-80GB"),
        ({"qos_factor": {"premium": 2}}, "qos_factor.premium"),
        ({"modles": {}}, "modles"),
        ({"models": [1, 2]}, "models"),
        ([1, 2], "prices.json"),
    ],
)
def test_bad_override_file_names_the_field(tmp_path: Path, body: object, field: str) -> None:
    path = _write(tmp_path, body)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        PriceTable.load(path)


def test_missing_or_invalid_file_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="GPUPOOL_PRICES.*fix the path"):
        PriceTable.load(env={"GPUPOOL_PRICES": str(tmp_path / "missing.json")})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="--prices.*not valid JSON"):
        PriceTable.load(bad)


def test_catalog_offers_are_cheapest_first() -> None:
    offers = catalog_offers()
    assert {o.name for o in offers} == set(CATALOG)
    assert [o.price_per_hour_usd for o in offers] == sorted(o.price_per_hour_usd for o in offers)
