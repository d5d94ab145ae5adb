"""Properties of the --simulate parser over generated specs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool_sdk.inventory.catalog import CATALOG
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import GpuInfo
from gpupool_sdk.store.codec import decode, encode

MODELS = sorted(CATALOG)


@st.composite
def pieces(draw: st.DrawFn, index: int) -> str:
    model = draw(st.sampled_from(MODELS))
    islands = draw(st.integers(1, 3))
    size = draw(st.integers(1, 4))
    count = islands * size
    nvlink = CATALOG[model].has("nvlink")
    topo = draw(st.sampled_from(["", ":pcie", ":nvlink", f":nvlink={islands}x{size}"] if nvlink else ["", ":pcie"]))
    repeat = draw(st.sampled_from(["", "2*"]))
    named = draw(st.booleans())
    return f"{'n' + str(index) + ':' if named else ''}{repeat}{count}x{model}{topo}"


@st.composite
def specs(draw: st.DrawFn) -> str:
    n = draw(st.integers(1, 4))
    return ",".join(draw(pieces(i)) for i in range(n))


@settings(max_examples=60, deadline=None)
@given(specs())
def test_generated_specs(spec: str) -> None:
    gpus = parse_cluster_spec(spec, default_node="host")
    assert gpus == parse_cluster_spec(spec, default_node="host")  # deterministic
    by_uuid = {g.uuid: g for g in gpus}
    assert len(by_uuid) == len(gpus)
    for g in gpus:
        assert g.simulated and g.health.healthy and g.uuid == f"GPU-sim-{g.node}-{g.index}"
        for p in g.nvlink_peers:
            peer = by_uuid[p]
            assert peer.node == g.node and peer.nvlink_island == g.nvlink_island and g.uuid in peer.nvlink_peers
        if g.nvlink_island is None:
            assert g.nvlink_peers == ()
        # what the agent publishes decodes to the same value (so an unchanged GPU is never rewritten)
        assert decode(f"/x/gpus/{g.node}/{g.uuid}", encode(g), GpuInfo) == g
