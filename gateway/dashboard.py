"""The KV pool dashboard: `/dashboard`, one page that draws every live worker's blocks, and
`/dashboard/state`, the JSON it polls (twice a second): the workers' heartbeats with their block maps
(shared.kv_map), the blocks reserved on each, the scheduler's queues and its latest routing decisions."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import redis

from gateway.metrics import kv_usage
from shared.keys import Keys
from shared.kv_map import count_states, decode_states
from shared.protocol import Heartbeat
from shared.registry import WorkerRegistry

logger = logging.getLogger(__name__)

PAGE = Path(__file__).parent / "page" / "dashboard.html"
ROUTES_SHOWN = 20  # routing decisions in the state, newest first


def worker_state(
    beat: Heartbeat, encoded_map: str | None, assigned: int, reserved: int, now: float
) -> dict[str, Any]:
    """One worker as the page shows it. The block counts come from its map, written in the same MULTI as
    its heartbeat (free + cached = the heartbeat's free_blocks); without a readable map they are None."""
    counts = None
    if encoded_map is not None:
        try:
            counts = count_states(decode_states(encoded_map))
        except ValueError as exc:
            logger.warning("unreadable KV map of worker %s: %s", beat.worker_id, exc)
            encoded_map = None
    queries, hits = beat.prefix_cache_queries_total, beat.prefix_cache_hits_total
    return {
        "worker_id": beat.worker_id,
        "model": beat.model,
        "total_blocks": beat.total_blocks,
        "free_blocks": beat.free_blocks,
        "block_size": beat.block_size,
        "kv_usage": kv_usage(beat),
        "blocks": counts,
        "kv_map": encoded_map,
        "reserved_blocks": reserved,
        "waiting_blocks": beat.waiting_blocks,
        "assigned": assigned,
        "num_running": beat.num_running,
        "num_waiting": beat.num_waiting,
        "num_preemptions": beat.num_preemptions,
        "prefix_hit_rate": hits / queries if queries else None,
        "heartbeat_age_s": max(0.0, now - beat.beat_at) if beat.beat_at else None,
        "draining": beat.draining,
        "device": beat.device,
        "dtype": beat.dtype,
    }


def read_state(client: redis.Redis, keys: Keys, registry: WorkerRegistry) -> dict[str, Any]:
    """Everything the page shows (four round trips: the registry's two, which read each worker's heartbeat
    and map as of one moment, the routing log, the scheduler's stats)."""
    snapshot = registry.read(with_load=True, with_maps=True)
    raw_routes: list[str] = client.lrange(keys.routing_log, 0, ROUTES_SHOWN - 1)  # type: ignore[assignment]
    now = time.time()
    workers = [
        worker_state(
            beat, snapshot.kv_maps[wid], snapshot.num_assigned[wid], snapshot.reserved_blocks[wid], now
        )
        for wid, beat in sorted(snapshot.live.items())
    ]
    routes = []
    for raw in raw_routes:
        try:
            routes.append(json.loads(raw))
        except ValueError:
            continue
    stats = registry.scheduler_stats()
    scheduler = None
    if stats is not None:
        scheduler = {
            "num_waiting": stats.num_waiting,
            "waiting_by_model": stats.waiting_by_model,
            "num_assigned": stats.num_assigned,
            "routing_policy": stats.routing_policy,
            "routed_hit_fraction": stats.routed_matched_blocks / stats.routed_prompt_blocks
            if stats.routed_prompt_blocks
            else None,
            "prefix_index_blocks": stats.prefix_index_blocks,
            "kv_resyncs": stats.kv_resyncs,
            "age_s": max(0.0, now - stats.updated_at),
        }
    return {"now": now, "workers": workers, "scheduler": scheduler, "routes": routes}
