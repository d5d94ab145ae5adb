"""Which node a process leases on (client/node.py) and where it stands in a launch (client/launch.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpupool_sdk.client.launch import LaunchInfo, launch_info
from gpupool_sdk.client.node import (
    AgentFile,
    PublishedNode,
    candidate_dirs,
    read_agent_files,
    remove_agent_file,
    resolve_node,
    write_agent_file,
)
from gpupool_sdk.errors import ConfigError

HOST = "box1"
A = PublishedNode("node-a", HOST, 100)
B = PublishedNode("node-b", HOST, 100)  # the same agent simulating a second node
REMOTE = PublishedNode("node-r", "box2", 200)
FILE_AB = AgentFile("/run/gpupool/agent-100.json", 100, HOST, ("node-a", "node-b"))
FILE_A = AgentFile("/run/gpupool/agent-100.json", 100, HOST, ("node-a",))
STALE = AgentFile("/run/gpupool/agent-999.json", 999, HOST, ("node-a",))  # a dead agent, or another pool's


@pytest.mark.parametrize(
    ("explicit", "env", "files", "published", "expect"),
    [
        ("node-x", "node-y", [FILE_AB], [A, B], "node-x"),  # the caller wins
        (None, "node-b", [FILE_AB], [A, B], "node-b"),  # then $GPUPOOL_NODE
        (None, None, [FILE_A], [A, REMOTE], "node-a"),  # then the agent's file, confirmed by etcd
        (None, None, [STALE, FILE_A], [A, REMOTE], "node-a"),
        (None, None, [FILE_AB], [A, B, REMOTE], "error:several nodes (node-a, node-b)"),
        (None, None, [STALE], [A, REMOTE], "node-a"),  # unconfirmed file: the node of an agent on this host
        (None, None, [], [A, B, REMOTE], "error:agents on host box1 publish several nodes"),
        (None, None, [], [REMOTE], "node-r"),  # a one-node pool: its only node
        (None, None, [], [REMOTE, PublishedNode("node-s", "box3", 3)], "error:the pool has 2 nodes"),
        (None, None, [], [], "error:the pool has no node yet"),
    ],
)
def test_resolve_node_table(
    explicit: str | None, env: str | None, files: list[AgentFile], published: list[PublishedNode], expect: str
) -> None:
    kw = {"explicit": explicit, "env_node": env, "agent_files": files, "published": published, "hostname": HOST,
          "dirs": ["/run/gpupool"]}
    if expect.startswith("error:"):
        with pytest.raises(ConfigError) as err:
            resolve_node(**kw)  # type: ignore[arg-type]
        msg = str(err.value)
        assert expect[6:] in msg
        assert "GPUPOOL_NODE" in msg  # every error names the override
        if "the pool has" in expect:  # nothing found: the message also names the agent and its file
            assert "gpupool agent" in msg and "/run/gpupool" in msg
    else:
        assert resolve_node(**kw)[0] == expect  # type: ignore[arg-type]


def test_agent_file_round_trip(tmp_path: Path) -> None:
    path = write_agent_file(["node-a", "node-b"], "/gpupool/v1", directory=tmp_path, pid=4242)
    assert path == tmp_path / "agent-4242.json"
    (tmp_path / "agent-1.json").write_text("{not json")  # a torn or foreign file is skipped
    (found,) = read_agent_files([tmp_path])
    assert found.pid == 4242 and found.nodes == ("node-a", "node-b") and found.prefix == "/gpupool/v1"
    remove_agent_file(path)
    remove_agent_file(path)  # idempotent
    assert read_agent_files([tmp_path]) == []


def test_runtime_dirs() -> None:
    assert candidate_dirs({"GPUPOOL_RUNTIME_DIR": "/x/y"}) == [Path("/x/y")]
    dirs = candidate_dirs({"XDG_RUNTIME_DIR": "/run/user/7"}, uid=7)
    assert dirs[0] == Path("/run/gpupool") and dirs[1] == Path("/run/user/7/gpupool") and dirs[2].name == "gpupool-7"


TORCHRUN_N1 = {  # torchrun --nnodes 2 --nproc-per-node 2, second node, second process
    "TORCHELASTIC_RUN_ID": "job", "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
}


@pytest.mark.parametrize(
    ("env", "expect"),
    [
        ({}, LaunchInfo("none")),
        (TORCHRUN_N1, LaunchInfo("torchrun", 4, 3, 1, 2, 2, 1)),
        ({k: v for k, v in TORCHRUN_N1.items() if k != "GROUP_WORLD_SIZE"}, LaunchInfo("torchrun", 4, 3, 1, 2, 2, 1)),
        (  # srun -N 3 --ntasks-per-node 2: third node, its first task
            {"SLURM_PROCID": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "2", "SLURM_NNODES": "3", "SLURM_NTASKS": "6",
             "SLURM_TASKS_PER_NODE": "2(x3)"},
            LaunchInfo("slurm", 6, 4, 0, 2, 3, 2),
        ),
        (
            {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2",
             "SLURM_NTASKS_PER_NODE": "1"},
            LaunchInfo("slurm", 2, 1, 0, 1, 2, 1),
        ),
        (  # torchrun inside srun: torchrun's variables win
            {**TORCHRUN_N1, "SLURM_PROCID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_NTASKS": "2"},
            LaunchInfo("torchrun", 4, 3, 1, 2, 2, 1),
        ),
        (  # Kubeflow PyTorchJob worker pod, process started without torchrun
            {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "1", "WORLD_SIZE": "2", "RANK": "1"},
            LaunchInfo("kubernetes", 2, 1, 0, 1, 2, 1),
        ),
        ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "1"},
         LaunchInfo("env", 2, 1, 0, 1, 2, 1)),
    ],
)
def test_launch_info_table(env: dict[str, str], expect: LaunchInfo) -> None:
    assert launch_info(env) == expect


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({**TORCHRUN_N1, "GROUP_RANK": "two"}, "GROUP_RANK"),
        ({**TORCHRUN_N1, "GROUP_RANK": "5"}, "GROUP_RANK"),
        ({"SLURM_PROCID": "0", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "x"},
         "SLURM_TASKS_PER_NODE"),
        ({"TORCHELASTIC_RUN_ID": "j", "RANK": "0"}, "WORLD_SIZE"),
    ],
)
def test_launch_info_names_the_bad_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        launch_info(env)
