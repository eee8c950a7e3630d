"""``/metrics``: the server's counts in Prometheus's text format."""

from __future__ import annotations

from collections import Counter

import kvrt

from .pool import Pool
from .state import StateStats

__all__ = ["exposition"]


def exposition(
    *,
    requests: Counter[tuple[str, int]],
    tokens: Counter[str],
    gone: Counter[str],
    cold: kvrt.ColdStats,
    pool: Pool,
    state: StateStats,
) -> str:
    """Requests, tokens, the cold store, sessions, kept state and clients that left."""
    lines = [
        "# HELP kvrt_requests_total Requests answered, by route and status.",
        "# TYPE kvrt_requests_total counter",
        *(
            f'kvrt_requests_total{{route="{route}",status="{status}"}} {n}'
            for (route, status), n in sorted(requests.items())
        ),
        "# HELP kvrt_tokens_total Tokens by what kvrt did with them.",
        "# TYPE kvrt_tokens_total counter",
        *(
            f'kvrt_tokens_total{{kind="{kind}"}} {tokens[kind]}'
            for kind in ("reused", "restored", "prefilled", "approximate", "generated")
        ),
        "# HELP kvrt_cold_store_bytes KV bytes held by the cold store.",
        "# TYPE kvrt_cold_store_bytes gauge",
        f"kvrt_cold_store_bytes {cold.bytes}",
        "# HELP kvrt_cold_store_budget_bytes The cold store's budget.",
        "# TYPE kvrt_cold_store_budget_bytes gauge",
        f"kvrt_cold_store_budget_bytes {cold.budget_bytes}",
        "# HELP kvrt_cold_store_entries Blocks held by the cold store.",
        "# TYPE kvrt_cold_store_entries gauge",
        f"kvrt_cold_store_entries {cold.entries}",
        "# HELP kvrt_cold_blocks_refused_total Stored blocks never used, by why: a "
        "shared tier's value whose tag fails (forged), that fails its checks (damaged) "
        "or is larger than any block (oversized); bytes the engine rejected (rejected).",
        "# TYPE kvrt_cold_blocks_refused_total counter",
        *(
            f'kvrt_cold_blocks_refused_total{{why="{why}"}} {n}'
            for why, n in _refused(cold).items()
        ),
        "# HELP kvrt_sessions Live sessions.",
        "# TYPE kvrt_sessions gauge",
        f"kvrt_sessions {len(pool.slots)}",
        "# HELP kvrt_sessions_busy Sessions serving a request.",
        "# TYPE kvrt_sessions_busy gauge",
        f"kvrt_sessions_busy {pool.busy}",
        "# HELP kvrt_queue_depth Requests waiting for a session.",
        "# TYPE kvrt_queue_depth gauge",
        f"kvrt_queue_depth {pool.waiting}",
        "# HELP kvrt_responses_stored Responses kept for previous_response_id (in a "
        "shared state server: 0, the server holds the count).",
        "# TYPE kvrt_responses_stored gauge",
        f"kvrt_responses_stored {state.responses}",
        "# HELP kvrt_responses_stored_bytes Bytes of the conversations they keep.",
        "# TYPE kvrt_responses_stored_bytes gauge",
        f"kvrt_responses_stored_bytes {state.response_bytes}",
        "# HELP kvrt_conversations_stored Conversations kept.",
        "# TYPE kvrt_conversations_stored gauge",
        f"kvrt_conversations_stored {state.conversations}",
        "# HELP kvrt_conversations_stored_bytes Bytes of their items.",
        "# TYPE kvrt_conversations_stored_bytes gauge",
        f"kvrt_conversations_stored_bytes {state.conversation_bytes}",
        "# HELP kvrt_state_refused_total Kept rows or values refused as damaged or forged.",
        "# TYPE kvrt_state_refused_total counter",
        f"kvrt_state_refused_total {state.refused}",
        "# HELP kvrt_state_failures_total Writes the state store could not make.",
        "# TYPE kvrt_state_failures_total counter",
        f"kvrt_state_failures_total {state.failures}",
        "# HELP kvrt_clients_gone_total Requests whose client left before the answer, by "
        "when (stalled: a stream closed after its client stopped reading).",
        "# TYPE kvrt_clients_gone_total counter",
        *(
            f'kvrt_clients_gone_total{{when="{when}"}} {gone[when]}'
            for when in ("body", "queued", "answer", "stalled")
        ),
    ]
    return "\n".join(lines) + "\n"
    return "\n".join(lines) + "\n"


def _refused(cold: kvrt.ColdStats) -> dict[str, int]:
    remote = cold.remote
    return {
        "forged": remote.forged if remote is not None else 0,
        "damaged": (remote.refused if remote is not None else 0)
        + (cold.disk.corrupt if cold.disk is not None else 0),
        "oversized": remote.oversized if remote is not None else 0,
        "rejected": cold.rejected,
    }
