import pytest

from gpupool_sdk.errors import SpecError, UnknownGpuModelError
from gpupool_sdk.inventory.simulated import parse_cluster_spec, parse_nodes
from gpupool_sdk.resources import GiB
from gpupool_sdk.store.keyspace import Keyspace


def nodes_of(gpus):
    out: dict[str, list] = {}
    for g in gpus:
        out.setdefault(g.node, []).append(g)
    return out


def test_single_node_uses_default_name():
    gpus = parse_cluster_spec("4xH100-80GB:nvlink", default_node="node-a")
    assert [g.uuid for g in gpus] == [f"GPU-sim-node-a-{i}" for i in range(4)]
    assert {g.node for g in gpus} == {"node-a"}
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    g = gpus[0]
    assert g.model == "H100-80GB" and g.memory_bytes == 80 * GiB and g.simulated
    assert g.sm_count == 132 and g.tflops["bf16"] > 900 and "fp8" in g.features
    assert g.health.healthy
    assert {g.nvlink_island for g in gpus} == {0}
    assert set(g.nvlink_peers) == {f"GPU-sim-node-a-{i}" for i in (1, 2, 3)}


def test_single_node_without_default():
    assert {g.node for g in parse_cluster_spec("2xT4")} == {"node-00"}


def test_multi_node():
    gpus = parse_cluster_spec("node-a:4xH100-80GB:nvlink,node-b:8xA100-40GB:pcie", default_node="ignored")
    by = nodes_of(gpus)
    assert sorted(by) == ["node-a", "node-b"]
    assert len(by["node-a"]) == 4 and len(by["node-b"]) == 8
    assert all(g.nvlink_island is None and g.nvlink_peers == () for g in by["node-b"])
    assert all(g.model == "A100-40GB" for g in by["node-b"])


def test_islands():
    gpus = parse_cluster_spec("8xH100:nvlink=2x4", default_node="n")
    assert [g.nvlink_island for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert set(gpus[5].nvlink_peers) == {"GPU-sim-n-4", "GPU-sim-n-6", "GPU-sim-n-7"}
    # peers are symmetric
    for g in gpus:
        for p in g.nvlink_peers:
            assert g.uuid in next(x for x in gpus if x.uuid == p).nvlink_peers


def test_pcie_and_numa():
    gpus = parse_cluster_spec("8xA100-40GB:pcie", default_node="n")
    paths = [g.pcie_path for g in gpus]
    assert paths[0] == paths[1] == "sim:n:pcie0" and paths[2] == "sim:n:pcie1" and len(set(paths)) == 4
    assert [g.numa_node for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_repeat_auto_names():
    gpus = parse_cluster_spec("16*8xV100-32GB:nvlink")
    by = nodes_of(gpus)
    assert sorted(by) == [f"node-{i:02d}" for i in range(16)]
    assert all(len(v) == 8 for v in by.values())


def test_repeat_with_name_prefix_and_shared_numbering():
    by = nodes_of(parse_cluster_spec("rack:3*2xT4,2*1xA10,1xL40S", default_node="host"))
    assert sorted(by) == ["host-00", "host-01", "host-02", "rack-00", "rack-01", "rack-02"]
    assert by["host-02"][0].model == "L40S-48GB"


def test_default_topology_follows_the_model():
    assert parse_cluster_spec("2xH100", "n")[0].nvlink_island == 0
    assert parse_cluster_spec("2xL40S", "n")[0].nvlink_island is None


def test_uuids_are_valid_key_segments_and_unique():
    ks = Keyspace()
    gpus = parse_cluster_spec("a.b_c:2xT4,2*3xH100:nvlink=3x1,x-1:2xA10", default_node="h")
    assert len({g.uuid for g in gpus}) == len(gpus)
    for g in gpus:
        ks.gpu(g.node, g.uuid)  # raises on an invalid segment


def test_deterministic():
    assert parse_cluster_spec("2*4xH100", "n") == parse_cluster_spec("2*4xH100", "n")


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("", "empty"),
        ("4xH100,", "stray comma"),
        ("4xFOO", "known models"),
        ("node-a:4xB200", "H100-80GB"),
        ("8xH100:nvlink=3x3", "must equal the GPU count"),
        ("8xH100:nvlink=2by4", "nvlink=ISLANDSxSIZE"),
        ("4xT4:nvlink", "has no NVLink"),
        ("4xH100:mesh", "unknown topology"),
        ("a:4xT4,a:2xT4", "declared twice"),
        ("bad name:4xT4", "node name"),
        ("node-a", "declares no GPUs"),
        ("node-a:4", "COUNTxMODEL"),
        ("0xT4", "between 1 and"),
        ("0*4xT4", "between 1 and"),
        ("a:4xT4:pcie:extra", "too many"),
        ("n-00:1xT4,2*1xT4", "declared twice"),
    ],
)
def test_errors_name_the_piece_and_fix(spec, needle):
    with pytest.raises(SpecError) as e:
        parse_cluster_spec(spec, default_node="n")
    assert needle in str(e.value)
    assert "simulate" in str(e.value)


def test_unknown_model_is_unknown_model_error():
    with pytest.raises(UnknownGpuModelError):
        parse_cluster_spec("2xRTX4090")


def test_bad_default_node():
    with pytest.raises(SpecError) as e:
        parse_cluster_spec("2xT4", default_node="bad/name")
    assert e.value.field == "node"


def test_parse_nodes_declarations():
    decls = parse_nodes("a:8xH100:nvlink=2x4,b:2xT4")
    assert [(d.name, d.count, d.islands) for d in decls] == [("a", 8, (4, 4)), ("b", 2, ())]


def test_auto_base_differs_from_default_node():
    by = nodes_of(parse_cluster_spec("2*1xT4", default_node="myhost", auto_base="node"))
    assert sorted(by) == ["node-00", "node-01"]
    assert {g.node for g in parse_cluster_spec("1xT4", default_node="myhost", auto_base="node")} == {"myhost"}
