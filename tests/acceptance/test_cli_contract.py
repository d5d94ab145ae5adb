"""The command-line contract, as an operator's script sees it: real ``gpupool`` processes, real etcd.

Exit codes (``gpupool_sdk/cli/common.py``): 0 ok, 1 failed, 2 bad usage or input, 3 etcd
unreachable, 4 not found. Every error message names the flag (or field) at fault and the fix;
no command answers bad input with a Python traceback.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from acceptance.cli import DEAD_ENDPOINT, ROOT, _env, explain, gpupool, gpupool_many
from gpupool_sdk.cli.common import EXIT_FAILED, EXIT_NOT_FOUND, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE
from gpupool_sdk.inventory.catalog import known_names
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import NodeInfo
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.launcher import EtcdServer

Etcdctl = Callable[..., subprocess.CompletedProcess[str]]


def _check_table(rows: list[tuple[list[str], int, list[str]]], workers: int = 4) -> None:
    """Run the rows' commands side by side; each must exit with its code and name every needle on stderr."""
    results = gpupool_many([args for args, _, _ in rows], workers=workers)
    bad = []
    for (_, code, needles), r in zip(rows, results, strict=True):
        missing = [n for n in needles if n not in r.stderr]
        if r.returncode != code or missing or "Traceback" in r.stderr:
            bad.append(f"expected rc {code}, stderr naming {missing}: {explain(r)}")
    assert not bad, "\n\n".join(bad)


# ---------------------------------------------------------------- etcd unreachable: exit 3


def test_every_command_with_etcd_unreachable_exits_3_naming_the_endpoint_and_the_fix() -> None:
    commands = [
        ["status"],
        ["status", "-o", "json"],
        ["top", "--timeout", "0.5"],
        ["top", "-o", "json", "--timeout", "0.5"],
        ["metrics", "report", "--timeout", "0.5"],
        ["metrics", "serve", "--port", "0", "--timeout", "0.5"],
        ["cordon", "GPU-x"],
        ["uncordon", "GPU-x"],
        ["drain", "node-x"],
        ["undrain", "node-x"],
        ["agent", "--simulate", "1xT4", "--ttl", "2"],
        ["coordinator", "--ttl", "2", "--loop-wait", "0.5", "--retry-timeout", "0.5"],
        ["run", "--name", "unreachable", "--memory", "1GiB", "--", "true"],
    ]
    def with_endpoint(c: list[str]) -> list[str]:
        at = c.index("--") if "--" in c else len(c)  # before `run`'s own command
        return [*c[:at], "--endpoints", DEAD_ENDPOINT, *c[at:]]

    rows = [(with_endpoint(c), EXIT_UNREACHABLE, [DEAD_ENDPOINT, "GPUPOOL_ENDPOINTS"]) for c in commands]
    _check_table(rows, workers=8)  # mostly waiting on refused connections
    from_env = gpupool("top", "--timeout", "0.5", env={"GPUPOOL_ENDPOINTS": DEAD_ENDPOINT})
    assert from_env.returncode == EXIT_UNREACHABLE and DEAD_ENDPOINT in from_env.stderr, explain(from_env)


def test_watching_commands_ride_out_an_etcd_outage_until_ctrl_c(tmp_path: Path) -> None:
    """``status -w`` and ``top -w`` show that etcd is gone, retry with a growing wait, and carry on when it is back."""
    server = EtcdServer(data_dir=tmp_path / "etcd", name="outage").start(timeout=60)
    watchers: dict[str, tuple[subprocess.Popen[str], Path, Path]] = {}
    try:
        for name, args in (("status", ["status", "-o", "json"]), ("top", ["top", "-o", "json", "--timeout", "0.5"])):
            out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
            with out.open("w") as o, err.open("w") as e:
                p = subprocess.Popen(
                    [sys.executable, "-m", "gpupool_sdk.cli.main", *args, "-w", "0.2", "--endpoints", server.endpoint],
                    stdout=o, stderr=e, text=True, cwd=ROOT, env=_env(None),
                )
            watchers[name] = (p, out, err)

        def docs(name: str) -> int:
            return watchers[name][1].read_text().count('"revision"')

        def wait(cond: Callable[[], bool], what: str) -> None:
            deadline = time.monotonic() + 60
            while not cond():
                for name, (p, _, err) in watchers.items():
                    assert p.poll() is None, f"{name} -w exited ({p.returncode}) {what}:\n{err.read_text()[-2000:]}"
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                time.sleep(0.1)

        wait(lambda: all(docs(n) >= 1 for n in watchers), "a first refresh")
        server.kill()
        # Two failed reads in a row, the second after a longer wait: retried with backoff, not exit 3.
        wait(lambda: all("retrying in 0.4s" in err.read_text() for _, _, err in watchers.values()), "retries")
        for name, (_, _, err) in watchers.items():
            text = err.read_text()
            assert "etcd unreachable" in text and server.endpoint in text and "retrying in 0.2s" in text, (name, text)
        seen = {n: docs(n) for n in watchers}
        server.start(timeout=60)
        wait(lambda: all(docs(n) > seen[n] for n in watchers), "a refresh after etcd came back")
        for name, (p, _, err) in watchers.items():
            p.send_signal(signal.SIGINT)
            assert p.wait(30) == EXIT_OK, f"{name}: {err.read_text()[-2000:]}"
    finally:
        for p, _, _ in watchers.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        server.stop()


# ---------------------------------------------------------------- bad usage or input: exit 2


def test_reporting_commands_refuse_bad_flags_with_exit_2() -> None:
    dead = ["--endpoints", DEAD_ENDPOINT]
    rows: list[tuple[list[str], int, list[str]]] = [
        (["status", "-w", "0", *dead], EXIT_USAGE, ["--watch"]),
        (["status", "-w", "nan", *dead], EXIT_USAGE, ["--watch", "finite"]),
        (["top", "-w", "inf", *dead], EXIT_USAGE, ["--watch", "finite"]),
        (["metrics", "report", "-w", "-1", *dead], EXIT_USAGE, ["--watch"]),
        (["top", "-o", "xml", *dead], EXIT_USAGE, ["--output", "table", "wide", "json", "yaml"]),
        (["top", "--timeout", "nan", *dead], EXIT_USAGE, ["timeout"]),
        (["status", "--prefix", "no-slash", *dead], EXIT_USAGE, ["prefix", "/gpupool/v1"]),
        (["status", "--endpoints", "not an endpoint"], EXIT_USAGE, ["endpoints", "host:port", "GPUPOOL_ENDPOINTS"]),
        (["cordon", "bad/uuid", *dead], EXIT_USAGE, ["gpu_uuid"]),
        (["metrics", "serve", "--port", "70000", *dead], EXIT_USAGE, ["--port"]),
    ]
    _check_table(rows)


def test_coordinator_refuses_bad_timing_and_settings_naming_the_flag() -> None:
    # An unreachable etcd: a setting the command failed to refuse would show as exit 3, not hang.
    base = ["coordinator", "--endpoints", DEAD_ENDPOINT]
    rows: list[tuple[list[str], int, list[str]]] = [
        ([*base, "--ttl", "-1"], EXIT_USAGE, ["--ttl"]),
        ([*base, "--ttl", "nan"], EXIT_USAGE, ["--ttl"]),  # was a ValueError traceback
        ([*base, "--ttl", "inf"], EXIT_USAGE, ["--ttl"]),  # was an OverflowError traceback
        # The timing relation loop_wait + 2 * retry_timeout <= ttl, with the numbers and the fix.
        ([*base, "--ttl", "10", "--loop-wait", "9", "--retry-timeout", "2"], EXIT_USAGE,
         ["--loop-wait", "9 + 2 * 2 = 13", "exceeds ttl", "raise --ttl"]),
        ([*base, "--ttl", "10", "--loop-wait", "0"], EXIT_USAGE, ["--loop-wait"]),
        ([*base, "--ttl", "10", "--retry-timeout", "nan"], EXIT_USAGE, ["--retry-timeout"]),
        ([*base, "--overcommit-ratio", "0.5"], EXIT_USAGE, ["--overcommit-ratio", "1.0"]),
        ([*base, "--preempt-grace", "-1"], EXIT_USAGE, ["--preempt-grace"]),
        ([*base, "--metrics-port", "99999"], EXIT_USAGE, ["--metrics-port"]),
        ([*base, "--prefix", "no-slash"], EXIT_USAGE, ["prefix", "/gpupool/v1"]),
    ]
    _check_table(rows)


def test_coordinator_refuses_nan_scheduler_settings() -> None:
    base = ["coordinator", "--endpoints", DEAD_ENDPOINT, "--ttl", "4", "--loop-wait", "1"]
    _check_table([([*base, flag, "nan"], EXIT_USAGE, [flag]) for flag in ("--overcommit-ratio", "--aging")])


def test_agent_refuses_a_malformed_simulate_spec_and_bad_flags() -> None:
    base = ["agent", "--endpoints", DEAD_ENDPOINT]
    rows: list[tuple[list[str], int, list[str]]] = [
        ([*base, "--simulate", "garbage"], EXIT_USAGE, ["--simulate", "declares no GPUs", "4xH100-80GB"]),
        ([*base, "--simulate", "4xH100-80GB:foo"], EXIT_USAGE, ["--simulate", "'foo'", "nvlink", "pcie"]),
        ([*base, "--simulate", "4xH100-80GB:nvlink=3x3"], EXIT_USAGE, ["--simulate", "nvlink=3x3", "nvlink=2x2"]),
        ([*base, "--simulate", "a:2xT4,a:2xT4"], EXIT_USAGE, ["--simulate", "declared twice"]),
        ([*base, "--simulate", "1xT4", "--node", "bad/node"], EXIT_USAGE, ["--node", "bad/node"]),
        ([*base, "--simulate", "1xT4", "--ttl", "-5"], EXIT_USAGE, ["--ttl"]),
        ([*base, "--simulate", "1xT4", "--refresh", "nan"], EXIT_USAGE, ["--refresh"]),
        ([*base, "--fault-file", "/tmp/faults.json"], EXIT_USAGE, ["--fault-file", "--simulate"]),
        (["run", "--name", "lots", "--memory", "lots", "--endpoints", DEAD_ENDPOINT, "--", "true"], EXIT_USAGE,
         ["memory", "'lots'", "24GiB"]),
    ]
    _check_table(rows)
    # Timing from the environment that breaks keepalive + 2 * retry <= ttl: the variables are named.
    r = gpupool("agent", "--simulate", "1xT4", "--endpoints", DEAD_ENDPOINT, env={"GPUPOOL_KEEPALIVE_INTERVAL": "9"})
    assert r.returncode == EXIT_USAGE and "Traceback" not in r.stderr, explain(r)
    assert "$GPUPOOL_KEEPALIVE_INTERVAL" in r.stderr and "9 + 2 * 3 = 15 exceeds ttl_s = 10" in r.stderr, explain(r)


def test_an_unknown_gpu_model_lists_the_known_ones(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("job_id,source,submit_s,num_gpu,gpu_fraction,priority\nj0,t,0,1,1.0,LS\n")
    agent, sim = gpupool_many([
        ["agent", "--simulate", "node-a:4xH999-80GB:nvlink", "--endpoints", DEAD_ENDPOINT],
        ["simulate", "--trace", str(trace), "--cluster", "2*4xH999-80GB:nvlink"],
    ])
    for r in (agent, sim):
        assert r.returncode == EXIT_USAGE, explain(r)
        assert "H999-80GB" in r.stderr and "Traceback" not in r.stderr, explain(r)
        assert all(name in r.stderr for name in known_names()), explain(r)
    assert "--simulate" in agent.stderr


def test_etcd_command_refuses_a_busy_port_and_an_unusable_data_dir(etcd_endpoint: str, tmp_path: Path) -> None:
    busy = etcd_endpoint.rsplit(":", 1)[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = str(s.getsockname()[1])
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    in_use, no_dir = gpupool_many([
        ["etcd", "--port", busy, "--peer-port", free, "--data-dir", str(tmp_path / "etcd"), "--timeout", "10"],
        ["etcd", "--port", free, "--data-dir", str(blocker / "data"), "--timeout", "10"],
    ])
    # Before the fix the busy port was reported "ready" (the other etcd answered /health), then "exited unexpectedly".
    assert in_use.returncode == EXIT_USAGE and "ready" not in in_use.stdout, explain(in_use)
    assert "--port" in in_use.stderr and "already in use" in in_use.stderr, explain(in_use)
    assert no_dir.returncode == EXIT_USAGE and "--data-dir" in no_dir.stderr and "Traceback" not in no_dir.stderr, explain(no_dir)
    bad_binary = gpupool("etcd", "--port", free, "--data-dir", str(tmp_path / "e2"),
                         env={"GPUPOOL_ETCD_BINARY": str(tmp_path / "no-such-etcd")})
    assert bad_binary.returncode == EXIT_FAILED, explain(bad_binary)
    assert "GPUPOOL_ETCD_BINARY" in bad_binary.stderr and "unset" in bad_binary.stderr, explain(bad_binary)


# ---------------------------------------------------------------- not found: exit 4, and idempotence


def _publish(store: EtcdStore) -> list[str]:
    lease = store.grant_lease(60)
    gpus = parse_cluster_spec("node-a:2xA100-40GB:pcie")
    for g in gpus:
        store.put(store.keys.gpu(g.node, g.uuid), g, lease=lease)
    store.put(store.keys.node("node-a"), NodeInfo(name="node-a", hostname="h", agent_pid=1, gpu_count=2,
                                                  backend="simulated", started_at=0.0), lease=lease)
    return [g.uuid for g in gpus]


def test_operator_intents_exit_4_for_unknown_targets_and_are_idempotent(store: EtcdStore, etcd_endpoint: str) -> None:
    uuids = _publish(store)
    ks = store.keys
    opts = ["--endpoints", etcd_endpoint, "--prefix", ks.prefix]
    unknown_gpu, unknown_gpu_json, unknown_node = gpupool_many([
        ["cordon", "GPU-nope", *opts], ["cordon", "GPU-nope", "-o", "json", *opts], ["drain", "node-zz", *opts],
    ])
    assert unknown_gpu.returncode == EXIT_NOT_FOUND, explain(unknown_gpu)
    assert "GPU-nope" in unknown_gpu.stderr and "--force" in unknown_gpu.stderr and "gpupool status" in unknown_gpu.stderr
    assert unknown_gpu_json.returncode == EXIT_NOT_FOUND and "GPU-nope" in json.loads(unknown_gpu_json.stdout)["error"]
    assert unknown_node.returncode == EXIT_NOT_FOUND and "node-zz" in unknown_node.stderr, explain(unknown_node)
    assert store.get(ks.cordon("GPU-nope")) is None and store.get(ks.drain("node-zz")) is None  # nothing written

    first, = gpupool_many([["cordon", uuids[1], "--reason", "ECC noise", "-o", "json", *opts]])
    assert first.returncode == EXIT_OK and json.loads(first.stdout)["changed"] is True, explain(first)
    again, drain, not_draining, not_cordoned = gpupool_many([
        ["cordon", uuids[1], "-o", "json", *opts], ["drain", "node-a", *opts], ["undrain", "node-zz", *opts],
        ["uncordon", uuids[0], *opts],
    ])
    assert again.returncode == EXIT_OK and json.loads(again.stdout)["changed"] is False, explain(again)
    assert drain.returncode == EXIT_OK and "draining" in drain.stdout, explain(drain)
    assert not_draining.returncode == EXIT_OK and "was not draining" in not_draining.stdout, explain(not_draining)
    assert not_cordoned.returncode == EXIT_OK and "was not cordoned" in not_cordoned.stdout, explain(not_cordoned)
    forced = gpupool("cordon", "GPU-later", "--force", *opts)
    assert forced.returncode == EXIT_OK and store.get(ks.cordon("GPU-later")) is not None, explain(forced)


def _strict_json(text: str) -> object:
    def refuse(name: str) -> object:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_json_output_of_every_reporting_command_is_strict_json(store: EtcdStore, etcd_endpoint: str, etcdctl: Etcdctl) -> None:
    _publish(store)
    etcdctl("put", store.keys.job_spec("hand-edited"), "{oops")
    opts = ["--endpoints", etcd_endpoint, "--prefix", store.keys.prefix]
    results = gpupool_many([["status", "-o", "json", *opts], ["top", "-o", "json", *opts],
                            ["metrics", "report", "-o", "json", *opts], ["status", *opts]])
    for r in results:
        assert r.returncode == EXIT_OK, explain(r)
    status, top, report, table = results
    assert [p["key"] for p in _strict_json(status.stdout)["problems"]] == [store.keys.job_spec("hand-edited")]  # type: ignore[index]
    assert len(_strict_json(top.stdout)["gpus"]) == 2  # type: ignore[index]
    assert "jobs" in _strict_json(report.stdout)  # type: ignore[operator]
    assert "skipped 1 malformed value" in top.stderr and store.keys.job_spec("hand-edited") in top.stderr
    assert "Problems" in table.stdout and "hand-edited" in table.stdout


def test_run_refuses_a_negative_acquire_timeout_naming_the_flag() -> None:
    r = gpupool("run", "--name", "neg", "--memory", "1GiB", "--acquire-timeout", "-1", "--endpoints", DEAD_ENDPOINT, "--", "true")
    assert r.returncode == EXIT_USAGE, explain(r)
    assert "--acquire-timeout" in r.stderr and "queueing" not in r.stderr, explain(r)
