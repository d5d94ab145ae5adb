"""Score / placement stage: which GPUs a job gets.

The ledger yields the GPUs that can take one slice in best-fit order (partly used first, least
leftover first, idle GPUs last and smallest first). Placement walks that order once and applies
the job's topology wish:

* one slice: the first candidate (best fit), or the first idle GPU while many are idle
  (``SchedulerConfig.spread_idle_above``: colocated jobs slow each other down);
  with ``SchedulerConfig.colocation_aware``, a shared slice packing onto a partly used GPU
  takes, among the GPUs within :data:`COLOCATION_TIE_BYTES` of the best fit, the one whose
  holders' measured utilisation sums lowest (a tie-breaker after best fit);
* ``pack``: the first NVLink island to collect enough candidates, else the first node to do so,
  else the fewest nodes (nodes with the most candidates first);
* ``spread``: the first candidate of each node, until enough distinct nodes;
* ``any``: the first candidates in best-fit order;
* a multi-node gang (``per_node``): exactly ``per_node`` slices on each of its member nodes
  (one NVLink island per node when possible), all or none.

A job restricted to some nodes (its spec's ``node``, a gang's members) only ever sees
candidates on those nodes (:meth:`Ledger.candidates`).

Slices of one gang always land on distinct GPUs. Elastic jobs (``min_count < count``) accept
fewer slices, down to ``min_count``, when the full count does not fit. Placement never mutates
the ledger: the caller reserves the result (all or nothing).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from gpupool_sdk.resources import QoS
from gpupool_sdk.scheduler.filter import SliceRequest
from gpupool_sdk.scheduler.ledger import Holding, Ledger

#: ``SchedulerConfig.colocation_aware``: partly used GPUs whose room left is within this many
#: bytes of the best fit's count as tied for a shared slice (1 GiB: a fraction of a T4's 16 GB).
COLOCATION_TIE_BYTES = float(1 << 30)
#: A holder that published no utilisation (not measured yet) counts as this busy.
COLOCATION_UNKNOWN_UTIL = 0.5
#: At most this many tied GPUs are compared (bounds the work per placement).
COLOCATION_MAX_TIED = 16


def place(ledger: Ledger, req: SliceRequest, avoid_nodes: Iterable[str] = ()) -> list[int] | None:
    """Choose GPUs for ``req``; returns ledger GPU indices (``min_count`` to ``count`` of them) or None."""
    count = req.count
    if count > 1 and ledger.candidate_bound(req) < req.min_count:
        return None  # every branch below needs min_count distinct candidates
    if req.per_node:
        return _per_node(ledger, req, avoid_nodes)
    if count == 1:
        cands1 = ledger.candidates(req, avoid_nodes, idle_first=ledger.prefers_idle(req))
        return _colocated(ledger, req, cands1) if req.colocate else _first(cands1)
    cands = ledger.candidates(req, avoid_nodes)
    if req.topology == "spread":
        return _spread(ledger, cands, count, req.min_count)
    if req.topology == "any":
        chosen = []
        for i in cands:
            chosen.append(i)
            if len(chosen) == count:
                return chosen
        return chosen if len(chosen) >= req.min_count else None
    if 1 < count <= ledger.max_island:
        # First pass: only GPUs of classes with large enough islands, stop at the first full island.
        island = _island(ledger, ledger.candidates(req, avoid_nodes, min_island=count), count)
        if island is not None:
            return island
    return _pack(ledger, cands, count, req.min_count)


def _per_node(ledger: Ledger, req: SliceRequest, avoid_nodes: Iterable[str]) -> list[int] | None:
    """A multi-node gang: exactly ``req.per_node`` slices on each of ``req.nodes``, all or none;
    on each node one NVLink island when one has room, else the node's best fits."""
    want = req.per_node
    if not req.nodes or want * len(req.nodes) != req.count:
        return None
    by_node: dict[str, list[int]] = {n: [] for n in req.nodes}
    nodes = ledger.nodes
    for i in ledger.candidates(req, avoid_nodes):
        lst = by_node.get(nodes[i])
        if lst is not None:
            lst.append(i)
    chosen: list[int] = []
    for node in req.nodes:
        cands = by_node[node]
        if len(cands) < want:
            return None
        island = _island(ledger, cands, want) if 1 < want <= ledger.max_island else None
        chosen.extend(island if island is not None else cands[:want])
    return chosen


def _island(ledger: Ledger, cands: Iterable[int], count: int) -> list[int] | None:
    nodes = ledger.nodes
    islands = ledger.islands
    by_island: dict[tuple[str, int], list[int]] = {}
    for i in cands:
        island = islands[i]
        if island is None:
            continue
        members = by_island.setdefault((nodes[i], island), [])
        members.append(i)
        if len(members) == count:
            return members
    return None


def _colocated(ledger: Ledger, req: SliceRequest, cands: Iterator[int]) -> list[int] | None:
    """Best fit, then the lightest partners: among the partly used GPUs whose fit is within
    :data:`COLOCATION_TIE_BYTES` of the best one, the GPU whose holders' measured utilisation
    sums lowest (first in best-fit order on equal sums)."""
    first = next(cands, None)
    if first is None:
        return None
    key0 = ledger.shared_fit_key(first)
    if key0 is None:  # an idle GPU: no partners to choose
        return [first]
    tied = [first]
    for i in cands:
        key = ledger.shared_fit_key(i)
        if key is None or key > key0 + COLOCATION_TIE_BYTES or len(tied) >= COLOCATION_MAX_TIED:
            break
        tied.append(i)
    if len(tied) == 1:
        return tied
    util = ledger.holders_util(tied, COLOCATION_UNKNOWN_UTIL)
    return [min(tied, key=util.__getitem__)]  # min keeps the first of equal sums


def _first(cands: Iterable[int]) -> list[int] | None:
    for i in cands:
        return [i]
    return None


def _spread(ledger: Ledger, cands: Iterable[int], count: int, min_count: int) -> list[int] | None:
    seen: set[str] = set()
    chosen: list[int] = []
    nodes = ledger.nodes
    for i in cands:
        node = nodes[i]
        if node in seen:
            continue
        seen.add(node)
        chosen.append(i)
        if len(chosen) == count:
            return chosen
    return chosen if len(chosen) >= min_count else None


def _pack(ledger: Ledger, cands: Iterable[int], count: int, min_count: int) -> list[int] | None:
    nodes = ledger.nodes
    by_node: dict[str, list[int]] = {}
    for i in cands:
        on_node = by_node.setdefault(nodes[i], [])
        on_node.append(i)
        if len(on_node) == count:
            return on_node
    # Fewest nodes: nodes with the most candidates first (ties in best-fit order of first sight).
    ranked = sorted(by_node.values(), key=lambda lst: -len(lst))
    chosen: list[int] = []
    for lst in ranked:
        chosen.extend(lst[: count - len(chosen)])
        if len(chosen) == count:
            return chosen
    return chosen if len(chosen) >= min_count else None


def holdings_for(ledger: Ledger, req: SliceRequest, gpus: Iterable[int]) -> list[Holding]:
    """The holdings a grant of ``req`` on ``gpus`` commits (exclusive slices take the whole GPU)."""
    out = []
    for i in gpus:
        if req.qos is QoS.EXCLUSIVE:
            out.append(Holding(i, QoS.EXCLUSIVE, ledger.loads[i].phys, 1.0, ledger.loads[i].phys))
        else:
            out.append(Holding(i, req.qos, req.memory, req.compute, req.peak, req.util))
    return out
