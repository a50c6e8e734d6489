"""The Ray Serve request router of the engine replicas: prefix affinity first, then the least loaded."""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from onnxgen.serving.affinity import AffinityTable, choose
from onnxgen.serving.asgi import ForwardedRequest


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router: a replica holding the request's prefix first (see
    :func:`onnxgen.serving.affinity.choose`), then the least loaded of two random others.

    Replicas may report the prefix digests their prefix cache holds as ``prefix_keys`` in their routing
    stats (a deployment's ``record_routing_stats``); the router prefers them to its own memory.
    """

    def initialize_state(self, slack: int = 16, capacity: int = 100_000) -> None:
        self.slack = slack
        self.table = AffinityTable(capacity)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        request = _forwarded(pending_request)
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {name: cache.get(r.replica_id) for name, r in by_id.items()}
        held = {name: r.routing_stats.get("prefix_keys", ()) for name, r in by_id.items()}
        key = request.routing if request is not None else None
        choice = choose(key, list(by_id), loads, self.table, self.slack, held)
        if request is not None:
            request.route = choice.how
        others = [r for name, r in by_id.items() if name != choice.replica]
        fallback = random.sample(others, min(2, len(others)))
        if choice.replica is None:
            return [fallback]
        return [[by_id[choice.replica]], fallback] if fallback else [[by_id[choice.replica]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = _forwarded(pending_request)
        if request is not None and request.routing is not None:
            self.table.record(request.routing, replica_id.to_full_id_str())


def _forwarded(pending_request: PendingRequest | None) -> ForwardedRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, ForwardedRequest) else None
