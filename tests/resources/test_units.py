import pytest

from gpupool_sdk.errors import SpecError
from gpupool_sdk.resources.units import GiB, MiB, format_size, parse_size


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("24GiB", 24 * GiB),
        ("512MiB", 512 * MiB),
        ("512 mib", 512 * MiB),
        ("1.5GiB", int(1.5 * GiB)),
        ("80GB", 80 * 10**9),
        ("80G", 80 * 10**9),
        # Kubernetes quantities: Ki/Mi/Gi/Ti are binary, as in a pod's resources.limits.
        ("20Gi", 20 * GiB),
        ("512Mi", 512 * MiB),
        ("1Ti", 1024 * GiB),
        ("64Ki", 64 * 1024),
        ("1024", 1024),
        (4096, 4096),
        (0, 0),
    ],
)
def test_parse_size(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["", "GiB", "12 parsecs", "-1GiB", -5, "1e3GB", "1Ei", True, None, [1]])
def test_parse_size_rejects_and_names_the_field(value):
    with pytest.raises(SpecError) as err:
        parse_size(value, field="memory")
    assert str(err.value).startswith("memory:")


def test_format_size_round_trips_roughly():
    assert format_size(3 * GiB) == "3.0GiB"
    assert format_size(512 * MiB) == "512.0MiB"
    assert format_size(10) == "10B"
