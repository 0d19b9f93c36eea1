"""Which engine pod gets a request step: pure functions of what the router observed, no I/O.

The router scores every ready candidate with an estimate of how long the step
would take there, in seconds, and takes the cheapest:

- **queue**: the candidate's load (the router's own in-flight steps to it plus
  ``vllm:num_requests_running + vllm:num_requests_waiting`` from its last
  scrape; the larger of the two, since the scrape already counts the router's
  steps once they arrive) times ``queue_seconds``;
- **KV work** (when block keys are known): blocks the engine must compute,
  times ``compute_block_seconds``, plus blocks it must load from the pool,
  times ``load_block_seconds``. An engine holding ``L`` leading blocks in its
  engine-local cache, with the pool holding ``P``, loads ``max(P - L, 0)`` and
  computes ``n - max(L, P)`` of the ``n`` full blocks. For a decode step after
  prefill ``P = n``: only the loads differ between pods.

So a pod's engine-local prefix wins exactly when what it saves (the pool loads,
or the compute of blocks beyond the pool's prefix) outweighs its extra queue.
A candidate whose last load scrape failed sorts after every healthy one: it is
probably gone, and the EndpointSlice has not caught up yet. Ties go to the
candidate the caller's ``tiebreak`` ranks first (a random order per request),
so equal pods share the load instead of the first one taking it all.

THE ROUTER KEEPS NO INDEX of which pod or pool holds what: every input here is
asked for per request (the pool, the pods' ``/daybreak/v1/prefix``) or scraped,
so a restarted router chooses exactly as the old one did.

**kvNamespace pairing.** Prefill and decode of one request must share a
kvNamespace (the pool keys blocks by it; mid-upgrade two are live). The router
takes each engine pod's namespace from its ``daybreak.dev/kv-namespace`` label,
picks the request's namespace first (``request_namespace``: the least-loaded
decode pod's, preferring a namespace prefill pods also serve), then restricts
both steps and the pool lookup to it (``in_namespace``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    """The router's estimate of a step's cost, in seconds; only the ratios matter for the choice."""

    compute_block_seconds: float = 0.010
    """Computing one block's KV (prefill of blocks the pool and the engine-local cache lack)."""
    load_block_seconds: float = 0.001
    """Loading one block from the pool into an engine."""
    queue_seconds: float = 0.050
    """What one request already running or waiting on the pod adds to a new step's latency."""


@dataclass(frozen=True)
class Candidate:
    """One ready pod as the router sees it right now."""

    address: str
    """``host:port`` of the engine."""
    load: int = 0
    """Running + waiting requests (see the module docstring for how the two sources combine)."""
    local_blocks: int = 0
    """Leading blocks of this request in the pod's engine-local cache (0 if unknown)."""
    healthy: bool = True
    """False when the pod's last load scrape failed."""
    kv_namespace: str | None = None
    """The pod's kvNamespace label; None when unknown (static endpoints: the router's ``--kv-namespace``)."""


def load_of(*, in_flight: int, running: float | None, waiting: float | None) -> int:
    """A pod's load: the larger of the router's own in-flight steps and the engine's running + waiting."""
    scraped = int((running or 0) + (waiting or 0))
    return max(in_flight, scraped)


def prefill_cost(*, blocks: int, pool_blocks: int, local_blocks: int, model: CostModel) -> float:
    """Seconds of work a prefill of ``blocks`` full blocks costs on an engine holding ``local_blocks``."""
    reused = min(max(local_blocks, pool_blocks), blocks)
    loaded = max(min(pool_blocks, blocks) - local_blocks, 0)
    return (blocks - reused) * model.compute_block_seconds + loaded * model.load_block_seconds


def rank(candidates: Sequence[Candidate], *, blocks: int = 0, pool_blocks: int = 0, prefix_aware: bool = False,
         model: CostModel = CostModel(), tiebreak: Mapping[str, int] | None = None) -> list[Candidate]:
    """Candidates best first. ``prefix_aware`` adds the KV work (compute and loads) to the queue cost."""
    order = tiebreak or {}

    def key(c: Candidate) -> tuple[bool, float, int, str]:
        cost = c.load * model.queue_seconds
        if prefix_aware:
            cost += prefill_cost(blocks=blocks, pool_blocks=pool_blocks, local_blocks=c.local_blocks, model=model)
        return (not c.healthy, round(cost, 9), order.get(c.address, 0), c.address)

    return sorted(candidates, key=key)


def pool_prefix(found: Sequence[bool]) -> int:
    """How many leading blocks the pool holds, from ``batch_exists`` of every block key."""
    for i, present in enumerate(found):
        if not present:
            return i
    return len(found)


def skip_prefill(*, blocks: int, pool_blocks: int, pool_known: bool) -> bool:
    """Prefill is skipped when the pool holds every full block (decode computes only the partial tail).

    Without a pool lookup (``pool_known`` False: no kvLayout, a vLLM deployment, or the pool
    unreachable) the router cannot know, so it always prefills.
    """
    return pool_known and pool_blocks >= blocks


def request_namespace(decode: Sequence[Candidate], *, prefill: Sequence[Candidate] | None = None,
                      default: str | None = None, tiebreak: Mapping[str, int] | None = None) -> str | None:
    """The kvNamespace a request runs in: that of the best decode pod, by load.

    Only namespaces some prefill pod also serves compete when there are any (mid-upgrade a request
    whose prefill and decode pods disagree would compute twice); with no labelled decode pod the
    ``default`` (the router's ``--kv-namespace``) applies.
    """
    labelled = [c for c in decode if c.kv_namespace]
    if not labelled:
        return default
    if prefill is not None:
        served = {c.kv_namespace for c in prefill if c.kv_namespace and c.healthy}
        labelled = [c for c in labelled if c.kv_namespace in served] or labelled
    return rank(labelled, tiebreak=tiebreak)[0].kv_namespace


def in_namespace(candidates: Sequence[Candidate], namespace: str | None) -> list[Candidate]:
    """The candidates that can serve a request of ``namespace`` (an unlabelled pod serves any)."""
    if namespace is None:
        return list(candidates)
    return [c for c in candidates if c.kv_namespace in (None, namespace)]
