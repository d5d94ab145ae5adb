"""Simulated GPUs declared with ``--simulate``: the grammar and its parser.

Grammar (whitespace around pieces is ignored, model names are case-insensitive)::

    spec      := node ("," node)*
    node      := [name ":"] [repeat "*"] count "x" model [":" topology] [":mig=" profile ("+" profile)*]
    topology  := "nvlink" | "nvlink=" islands "x" size | "pcie"

Examples:

- ``4xH100-80GB:nvlink`` -- one node with four H100s in one NVLink island, named by
  ``default_node`` (the agent's ``--node``, else the host name).
- ``node-a:4xH100-80GB:nvlink,node-b:8xA100-40GB:pcie`` -- two named nodes.
- ``8xH100:nvlink=2x4`` -- two NVLink islands of four GPUs (islands x size must equal count).
- ``16*8xV100-32GB:nvlink`` -- sixteen identical nodes.
- ``node-a:1xA100-80GB:mig=3g.40gb+3g.40gb`` -- one A100 in MIG mode with two 3g.40gb
  instances, published as two GPUs ``MIG-sim-node-a-0-0`` and ``MIG-sim-node-a-0-1`` (every GPU
  of the node gets the same layout; see :mod:`gpupool_sdk.inventory.mig`).

Node names:

- A named piece without a repeat is that node: ``node-a:4xT4``.
- A repeat always numbers its nodes ``{base}-{i:02d}``; the base is the piece's name if given
  (``rack:4*8xH100`` is ``rack-00`` .. ``rack-03``), else ``auto_base`` (the agent's ``--node``
  when given), else ``default_node``, else ``node``.
- Unnamed pieces share one numbering across the spec (``2*4xT4,8xA10`` is ``node-00``,
  ``node-01``, ``node-02``), except a spec that is a single unnamed piece without a repeat, which
  is ``default_node`` itself (``node-00`` when no default is given).
- Duplicate node names are an error.

The topology defaults to ``nvlink`` (one island) for models with NVLink, ``pcie`` otherwise;
asking for NVLink on a model without it is an error.

Synthesised topology: UUIDs are ``GPU-sim-{node}-{index}`` (valid etcd key segments, stable
across restarts); each island's GPUs list each other as ``nvlink_peers``; every two consecutive
GPUs share a PCIe switch (``pcie_path`` ``sim:{node}:pcie{switch}``); nodes of four or more GPUs
split them over two NUMA nodes, first half on NUMA 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpupool_sdk.errors import SpecError
from gpupool_sdk.inventory.catalog import GpuModel, lookup_model
from gpupool_sdk.inventory.mig import MigProfile, parse_layout, simulated_instances
from gpupool_sdk.resources.gpu import GpuInfo

FIELD = "simulate"
MAX_GPUS_PER_NODE = 256
MAX_REPEAT = 10_000
GPUS_PER_PCIE_SWITCH = 2
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_GROUP_RE = re.compile(r"^(?:(?P<repeat>\d+)\s*\*\s*)?(?P<count>\d+)\s*[xX]\s*(?P<model>\S+)$")
_LOOKS_LIKE_GROUP_RE = re.compile(r"^(\d+\s*\*\s*)?\d+\s*[xX]")
_ISLANDS_RE = re.compile(r"^(\d+)\s*[xX]\s*(\d+)$")


@dataclass(frozen=True)
class NodeDecl:
    """One simulated node after parsing: its name, model, GPU count and NVLink island sizes.

    Attributes:
        name: node name.
        model: catalog model of every GPU on the node.
        count: number of GPUs.
        islands: sizes of the NVLink islands in index order (empty for ``pcie``).
    """

    name: str
    model: GpuModel
    count: int
    islands: tuple[int, ...]
    mig: tuple[MigProfile, ...] = ()

    def gpus(self) -> list[GpuInfo]:
        """The node's GPUs with synthesised UUIDs, NVLink islands, PCIe switches and NUMA nodes."""
        uuids = [simulated_uuid(self.name, i) for i in range(self.count)]
        island_of: list[int | None] = [None] * self.count
        members: list[list[int]] = []
        start = 0
        for island, size in enumerate(self.islands):
            members.append(list(range(start, start + size)))
            for i in range(start, start + size):
                island_of[i] = island
            start += size
        half = (self.count + 1) // 2
        out = []
        for i in range(self.count):
            isl = island_of[i]
            peers = tuple(uuids[j] for j in members[isl] if j != i) if isl is not None else ()
            out.append(
                self.model.gpu_info(
                    uuid=uuids[i],
                    node=self.name,
                    index=i,
                    nvlink_peers=peers,
                    nvlink_island=isl,
                    pcie_path=f"sim:{self.name}:pcie{i // GPUS_PER_PCIE_SWITCH}",
                    numa_node=(0 if i < half else 1) if self.count >= 4 else 0,
                    simulated=True,
                )
            )
        if self.mig:
            return [inst for g in out for inst in simulated_instances(g, self.mig)]
        return out


def simulated_uuid(node: str, index: int) -> str:
    """The stable UUID of simulated GPU ``index`` on ``node``: ``GPU-sim-{node}-{index}``."""
    return f"GPU-sim-{node}-{index}"


def parse_nodes(spec: str, default_node: str | None = None, auto_base: str | None = None) -> list[NodeDecl]:
    """Parse a ``--simulate`` spec into node declarations (see the module docstring).

    Args:
        spec: the spec string.
        default_node: name of the node for a single unnamed piece, and base of auto-numbered names.
        auto_base: base of auto-numbered names when it should differ from ``default_node`` (the
            agent names a single node after the host but numbers several ``node-NN``).

    Raises:
        SpecError: a piece is malformed; the message names the piece and the fix.
        UnknownGpuModelError: a model is not in the catalog (the message lists the known ones).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(FIELD, "is empty; declare GPUs such as '4xH100-80GB:nvlink' or 'node-a:8xA100-40GB:pcie'")
    for what, value in (("node", default_node), ("node", auto_base)):
        if value is not None and not _NAME_RE.match(value):
            raise SpecError(what, f"{value!r} is not a valid node name; use letters, digits, '.', '_' or '-'")
    pieces = [p.strip() for p in spec.split(",")]
    parsed = []
    for n, piece in enumerate(pieces):
        where = f"{FIELD} piece {n + 1} {piece!r}"
        if not piece:
            raise SpecError(FIELD, f"piece {n + 1} is empty (stray comma?) in {spec!r}")
        parsed.append(_parse_piece(piece, where))

    single = len(parsed) == 1 and parsed[0][0] is None and parsed[0][1] is None
    auto_base = auto_base or default_node or "node"
    auto_next = 0
    auto_total = sum((p[1] or 1) for p in parsed if p[0] is None)
    nodes: list[NodeDecl] = []
    seen: dict[str, str] = {}
    for (name, repeat, count, model, islands, mig), piece in zip(parsed, pieces, strict=True):
        if single:
            names = [default_node or f"{auto_base}-00"]
        elif name is not None and repeat is None:
            names = [name]
        elif name is not None:
            assert repeat is not None
            names = [f"{name}-{i:0{_width(repeat)}d}" for i in range(repeat)]
        else:
            r = repeat or 1
            names = [f"{auto_base}-{auto_next + i:0{_width(auto_total)}d}" for i in range(r)]
            auto_next += r
        for node in names:
            if node in seen:
                raise SpecError(
                    FIELD,
                    f"node name {node!r} is declared twice (by {seen[node]!r} and {piece!r}); "
                    "give each piece its own name, e.g. 'node-a:4xH100,node-b:4xH100'",
                )
            seen[node] = piece
            nodes.append(NodeDecl(node, model, count, islands, mig))
    return nodes


def parse_cluster_spec(spec: str, default_node: str | None = None, auto_base: str | None = None) -> list[GpuInfo]:
    """Parse a ``--simulate`` spec into the GPUs it declares, node by node, in index order.

    Args:
        spec: e.g. ``"node-a:4xH100-80GB:nvlink,node-b:8xA100-40GB:pcie"`` or ``"4xT4"``.
        default_node: the node name for a single unnamed piece (the agent passes ``--node`` or the
            host name), and the base of auto-numbered names.
        auto_base: base of auto-numbered names, when it should differ from ``default_node``.

    Returns:
        Every GPU, with ``simulated=True``, stable UUIDs, NVLink peers and islands, PCIe paths
        and NUMA nodes filled in.

    Raises:
        SpecError: a piece is malformed; the message names the piece and the fix.

    Example:
        >>> [g.uuid for g in parse_cluster_spec("2xH100:nvlink", default_node="n1")]
        ['GPU-sim-n1-0', 'GPU-sim-n1-1']
    """
    return [g for node in parse_nodes(spec, default_node, auto_base) for g in node.gpus()]


def _width(n: int) -> int:
    return max(2, len(str(max(n - 1, 0))))


def _parse_piece(
    piece: str, where: str
) -> tuple[str | None, int | None, int, GpuModel, tuple[int, ...], tuple[MigProfile, ...]]:
    parts = [p.strip() for p in piece.split(":")]
    mig_parts = [p for p in parts if p.lower().startswith("mig=")]
    parts = [p for p in parts if not p.lower().startswith("mig=")]
    if len(mig_parts) > 1:
        raise SpecError(where, "declares the MIG layout twice; write one ':mig=PROFILE+PROFILE...'")
    name: str | None = None
    if not _LOOKS_LIKE_GROUP_RE.match(parts[0]):
        name = parts.pop(0)
        if not _NAME_RE.match(name):
            raise SpecError(
                where,
                f"node name {name!r} is invalid; use letters, digits, '.', '_' or '-' "
                "(e.g. 'node-a:4xH100-80GB'), or start the piece with COUNTxMODEL",
            )
        if not parts:
            raise SpecError(where, f"node {name!r} declares no GPUs; write e.g. '{name}:4xH100-80GB:nvlink'")
    if len(parts) > 2:
        raise SpecError(
            where,
            "has too many ':' parts; the form is [NAME:][REPEAT*]COUNTxMODEL[:nvlink|:nvlink=AxB|:pcie]",
        )
    m = _GROUP_RE.match(parts[0])
    if not m:
        raise SpecError(where, f"{parts[0]!r} is not COUNTxMODEL; write e.g. '4xH100-80GB' or '16*8xV100-32GB'")
    repeat = int(m.group("repeat")) if m.group("repeat") is not None else None
    count = int(m.group("count"))
    if repeat is not None and not 1 <= repeat <= MAX_REPEAT:
        raise SpecError(where, f"repeat {repeat} must be between 1 and {MAX_REPEAT}")
    if not 1 <= count <= MAX_GPUS_PER_NODE:
        raise SpecError(where, f"GPU count {count} must be between 1 and {MAX_GPUS_PER_NODE}")
    model = lookup_model(m.group("model"), field_name=where)
    topo = parts[1].lower() if len(parts) == 2 else None
    islands = _parse_topology(topo, count, model, where)
    mig: tuple[MigProfile, ...] = ()
    if mig_parts:
        mig = parse_layout(mig_parts[0][len("mig=") :], model.name, model.memory_bytes, where)
    return name, repeat, count, model, islands, mig


def _parse_topology(topo: str | None, count: int, model: GpuModel, where: str) -> tuple[int, ...]:
    if topo is None:
        return (count,) if model.has("nvlink") else ()
    if topo == "pcie":
        return ()
    if topo == "nvlink" or topo.startswith("nvlink="):
        if not model.has("nvlink"):
            raise SpecError(where, f"{model.name} has no NVLink; use ':pcie' (or omit the topology)")
        if topo == "nvlink":
            return (count,)
        m = _ISLANDS_RE.match(topo[len("nvlink=") :].strip())
        if not m:
            raise SpecError(where, f"topology {topo!r} is not nvlink=ISLANDSxSIZE; write e.g. 'nvlink=2x4'")
        islands, size = int(m.group(1)), int(m.group(2))
        if islands < 1 or size < 1 or islands * size != count:
            raise SpecError(
                where,
                f"topology nvlink={islands}x{size} covers {islands * size} GPUs but the node has {count}; "
                f"the islands times their size must equal the GPU count (e.g. nvlink=2x{max(count // 2, 1)})",
            )
        return (size,) * islands
    raise SpecError(where, f"unknown topology {topo!r}; use 'nvlink', 'nvlink=AxB' (e.g. nvlink=2x4) or 'pcie'")
