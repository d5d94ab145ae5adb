"""Which pool node this process runs on (node-local leasing).

A training process may only use its own machine's GPUs, so every spec it submits names its node
(``JobSpec.node``). The node comes from, in this order:

1. the caller: ``JobSpec(node=...)`` or ``PoolClient(node=...)``;
2. ``$GPUPOOL_NODE`` (required when one agent declares several simulated nodes on one machine:
   each process says which one it is on);
3. the node-local agent's file: ``gpupool agent`` writes ``agent-<pid>.json`` naming the node(s)
   it publishes into the runtime directory (:func:`runtime_dir`); a file counts only when etcd
   confirms it (``nodes/{node}`` is published by that pid on this host), so stale files and
   files of other pools on the same machine are ignored;
4. the nodes published in etcd by an agent on this host name (a runtime directory the client
   cannot read, e.g. an agent run by another user);
5. a pool of exactly one node: that node (one machine, or a single-node test pool).

``PoolClient(node="*")`` (:data:`ANY_NODE`) opts out: specs go without a node and may be granted
on any node (tools and tests that hold slices without running on them, never a training process).

Anything else, or more than one candidate at the first step that finds any, is a
:class:`~gpupool_sdk.errors.ConfigError` naming both fixes (``GPUPOOL_NODE`` and the agent).
:func:`resolve_node` is pure (table-tested); the file and etcd reads are done by the caller.

Runtime directory: ``$GPUPOOL_RUNTIME_DIR`` when set; else the first usable of ``/run/gpupool``,
``$XDG_RUNTIME_DIR/gpupool`` and ``/tmp/gpupool-$UID`` (the agent writes into the first it can
create or write; clients read every one that exists).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpupool_sdk.errors import ConfigError

log = logging.getLogger(__name__)

NODE_ENV = "GPUPOOL_NODE"
#: ``PoolClient(node=ANY_NODE)`` (or ``GPUPOOL_NODE=*``): submit specs without a node, to be
#: granted anywhere. For tools and tests that hold slices without running on them.
ANY_NODE = "*"
RUNTIME_DIR_ENV = "GPUPOOL_RUNTIME_DIR"
AGENT_FILE_KIND = "AgentNodes"
_SCHEMA = 1


def candidate_dirs(env: Mapping[str, str] | None = None, uid: int | None = None) -> list[Path]:
    """The runtime directories, in order: ``$GPUPOOL_RUNTIME_DIR`` alone when set, else
    ``/run/gpupool``, ``$XDG_RUNTIME_DIR/gpupool``, ``/tmp/gpupool-$UID``."""
    env = os.environ if env is None else env
    explicit = env.get(RUNTIME_DIR_ENV)
    if explicit:
        return [Path(explicit)]
    uid = os.getuid() if uid is None else uid
    dirs = [Path("/run/gpupool")]
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg:
        dirs.append(Path(xdg) / "gpupool")
    dirs.append(Path(tempfile.gettempdir()) / f"gpupool-{uid}")
    return dirs


def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """The directory the agent writes its node file into (created when missing).

    Raises:
        ConfigError: ``$GPUPOOL_RUNTIME_DIR`` is set but cannot be created or written.
    """
    env = os.environ if env is None else env
    dirs = candidate_dirs(env)
    for d in dirs:
        try:
            d.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK | os.X_OK):
            return d
    if env.get(RUNTIME_DIR_ENV):
        raise ConfigError(RUNTIME_DIR_ENV, f"{dirs[0]} cannot be created or written; point it at a writable directory")
    raise ConfigError(RUNTIME_DIR_ENV, f"none of {', '.join(map(str, dirs))} is writable; set it to a writable directory")


@dataclass(frozen=True)
class AgentFile:
    """What a node agent's file says: the agent process and the node(s) it publishes.

    Attributes:
        path: where it was read.
        pid: the agent's process id.
        hostname: the host it runs on.
        nodes: the node names it publishes.
        prefix: the pool's key prefix.
    """

    path: str
    pid: int
    hostname: str
    nodes: tuple[str, ...]
    prefix: str = ""


@dataclass(frozen=True)
class PublishedNode:
    """A node as etcd shows it (``nodes/{node}``): its name and the agent that publishes it."""

    name: str
    hostname: str
    agent_pid: int


def write_agent_file(nodes: Sequence[str], prefix: str, directory: Path | None = None, pid: int | None = None) -> Path:
    """Write ``agent-<pid>.json`` naming ``nodes`` into the runtime directory (atomically).

    Returns:
        The file's path (remove it with :func:`remove_agent_file` when the agent stops).
    """
    directory = runtime_dir() if directory is None else directory
    pid = os.getpid() if pid is None else pid
    path = directory / f"agent-{pid}.json"
    body = {
        "schema": _SCHEMA,
        "kind": AGENT_FILE_KIND,
        "pid": pid,
        "hostname": socket.gethostname(),
        "nodes": list(nodes),
        "prefix": prefix,
        "written_at": time.time(),
    }
    fd, tmp = tempfile.mkstemp(prefix=f".agent-{pid}.", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def remove_agent_file(path: Path) -> None:
    """Remove an agent file written by :func:`write_agent_file` (missing is fine)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def read_agent_files(dirs: Sequence[Path] | None = None) -> list[AgentFile]:
    """Every readable ``agent-*.json`` in the runtime directories (malformed ones are skipped)."""
    out: list[AgentFile] = []
    for d in candidate_dirs() if dirs is None else dirs:
        try:
            paths = sorted(d.glob("agent-*.json"))
        except OSError:
            continue
        for p in paths:
            try:
                body = json.loads(p.read_text())
                if body.get("kind") != AGENT_FILE_KIND or body.get("schema") != _SCHEMA:
                    continue
                nodes = body["nodes"]
                if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
                    continue
                out.append(
                    AgentFile(
                        path=str(p),
                        pid=int(body["pid"]),
                        hostname=str(body.get("hostname", "")),
                        nodes=tuple(nodes),
                        prefix=str(body.get("prefix", "")),
                    )
                )
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.debug("skipping agent file %s: %s", p, exc)
    return out


def _fix(dirs: Sequence[str]) -> str:
    where = ", ".join(dirs) if dirs else "the runtime directory"
    return (
        f"set {NODE_ENV}=<node> (or PoolClient(node=...) / JobSpec(node=...)) to the node this process runs on, "
        f"or run `gpupool agent` on this machine (it writes agent-<pid>.json naming its node into {where})"
    )


def resolve_node(
    *,
    explicit: str | None,
    env_node: str | None,
    agent_files: Sequence[AgentFile],
    published: Sequence[PublishedNode],
    hostname: str,
    dirs: Sequence[str] = (),
) -> tuple[str, str]:
    """The node this process runs on, and how it was found (pure; see the module docstring).

    Args:
        explicit: ``JobSpec.node`` or ``PoolClient(node=...)``.
        env_node: ``$GPUPOOL_NODE``.
        agent_files: the agent files found in the runtime directories.
        published: every node in etcd with the agent that publishes it.
        hostname: this machine's host name.
        dirs: the runtime directories searched (for the error message).

    Returns:
        ``(node, how)``, ``how`` naming the source (for logs).

    Raises:
        ConfigError: no node, or several candidates; the message names ``GPUPOOL_NODE`` and the agent.

    Example:
        >>> resolve_node(explicit=None, env_node=None, agent_files=[AgentFile("f", 7, "h", ("node-a",))],
        ...              published=[PublishedNode("node-a", "h", 7), PublishedNode("node-b", "g", 9)], hostname="h")
        ('node-a', 'the agent file f')
    """
    if explicit:
        return explicit, "the caller (node=...)"
    if env_node:
        return env_node, f"${NODE_ENV}"
    by_name = {p.name: p for p in published}
    confirmed: dict[str, str] = {}
    for f in agent_files:
        for n in f.nodes:
            p = by_name.get(n)
            if p is not None and p.agent_pid == f.pid and p.hostname == f.hostname:
                confirmed[n] = f.path
    if len(confirmed) == 1:
        ((node, path),) = confirmed.items()
        return node, f"the agent file {path}"
    if len(confirmed) > 1:
        names = ", ".join(sorted(confirmed))
        raise ConfigError(
            NODE_ENV,
            f"the agents on this machine publish several nodes ({names}); say which one this process runs on: "
            f"set {NODE_ENV} to one of them (or PoolClient(node=...))",
        )
    local = sorted(p.name for p in published if hostname and p.hostname == hostname)
    if len(local) == 1:
        return local[0], f"the node published by an agent on host {hostname}"
    if len(local) > 1:
        raise ConfigError(
            NODE_ENV,
            f"agents on host {hostname} publish several nodes ({', '.join(local)}); set {NODE_ENV} to the one this "
            "process runs on (or PoolClient(node=...))",
        )
    if len(published) == 1:
        return published[0].name, "the pool's only node"
    if not published:
        detail = "the pool has no node yet and no agent file names one"
    else:
        detail = f"no agent on this machine ({hostname}) publishes a node, and the pool has {len(published)} nodes"
    raise ConfigError(NODE_ENV, f"cannot tell which node this process runs on: {detail}; {_fix(dirs)}")
