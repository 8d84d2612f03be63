"""What the rollout server reports at `GET /metrics`: one snapshot of its counters and gauges, rendered as
Prometheus text (what scrapers and vLLM users expect at that path) or as the JSON object trl_cb's own tools read.

Why one snapshot, two renderings: the values are read once per scrape (the engine's stats, its queue, the weight
receiver), and both formats say the same thing, so a dashboard and a test polling the JSON never disagree.

Invariants: every series (Prometheus) and every key (JSON) is present in every answer, zeros included, so dashboards
have no gaps; counters only grow while the server lives; the Prometheus text follows the exposition format 0.0.4
(`# HELP`, `# TYPE`, then samples; label values escaped). Which rendering a request gets: `wants_json`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["PROMETHEUS_CONTENT_TYPE", "RequestCounters", "metrics_snapshot", "prometheus_text", "wants_json"]

#: Prometheus' text exposition format (Starlette adds `; charset=utf-8`, as `prometheus_client` sends it).
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4"


@dataclass
class RequestCounters:
    """The server's own counts (the engine counts groups and tokens itself)."""

    served: int = 0  # requests answered whole (a request flow that ended)
    rejected: int = 0  # requests refused with a 4xx before generating
    prompt_tokens: int = 0  # prompt tokens of accepted requests, each prompt once (OpenAI's `usage.prompt_tokens`)


def metrics_snapshot(engine_loop: Any, weights: Any, counters: RequestCounters) -> dict[str, Any]:
    """The JSON object (`Accept: application/json`): every key always present (docs/server.md, HTTP API)."""
    stats = engine_loop.stats
    waiting, running = engine_loop.queue_depth()
    uptime = time.time() - stats.started
    return {
        "requests_served": counters.served,
        "requests_rejected": counters.rejected,
        "prompt_tokens": counters.prompt_tokens,
        "groups_finished": stats.groups_finished,
        "groups_cancelled": stats.groups_cancelled,
        "queue_groups": waiting,
        "running_groups": running,
        "tokens_generated": stats.tokens_generated,
        "tokens_per_s": stats.tokens_generated / max(uptime, 1e-9),
        "engine_builds": stats.engine_builds,
        "paused": engine_loop.paused,
        "weight_version": engine_loop.version,
        "weight_updates_in_flight": stats.weight_updates_in_flight,
        "weight_sync_open": weights.is_open,
        "weight_sync_error": weights.last_error,
        "weight_sync_dropped_owners": weights.dropped_owners,
        "uptime_s": uptime,
    }


#: (series, type, help, [(labels, snapshot key or callable)]): what the Prometheus text holds, in order.
_SERIES: list[tuple[str, str, str, list[tuple[dict[str, str], Any]]]] = [
    ("trl_cb_requests_total", "counter", "Requests by outcome: served (answered), rejected (4xx before generating).",
     [({"outcome": "served"}, "requests_served"), ({"outcome": "rejected"}, "requests_rejected")]),
    ("trl_cb_prompt_tokens_total", "counter", "Prompt tokens of accepted requests (each prompt once).",
     [({}, "prompt_tokens")]),
    ("trl_cb_generation_tokens_total", "counter", "Tokens sampled.", [({}, "tokens_generated")]),
    ("trl_cb_groups_total", "counter", "Groups (a prompt's n samples) by outcome.",
     [({"outcome": "finished"}, "groups_finished"), ({"outcome": "cancelled"}, "groups_cancelled")]),
    ("trl_cb_queue_groups", "gauge", "Groups waiting for room in the engine.", [({}, "queue_groups")]),
    ("trl_cb_running_groups", "gauge", "Groups generating in the engine.", [({}, "running_groups")]),
    ("trl_cb_engine_builds_total", "counter", "Engine (re)builds.", [({}, "engine_builds")]),
    ("trl_cb_paused", "gauge", "1 while generation is paused (/pause).", [({}, "paused")]),
    ("trl_cb_weight_version", "gauge", "Weight version being served.", [({}, "weight_version")]),
    ("trl_cb_weight_updates_in_flight_total", "counter", "Weight updates applied while requests were generating.",
     [({}, "weight_updates_in_flight")]),
    ("trl_cb_weight_sync_open", "gauge", "1 while a trainer's weight-sync group is open.", [({}, "weight_sync_open")]),
    ("trl_cb_weight_sync_failed", "gauge", "1 while the last weight update failed (its reason: the JSON metrics).",
     [({}, lambda snapshot: snapshot["weight_sync_error"] is not None)]),
    ("trl_cb_weight_sync_dropped_owners_total", "counter", "Weight-sync groups dropped: their trainer was gone.",
     [({}, "weight_sync_dropped_owners")]),
    ("trl_cb_uptime_seconds", "gauge", "Seconds since the server started.", [({}, "uptime_s")]),
]  # fmt: skip


def prometheus_text(snapshot: dict[str, Any], info: dict[str, str]) -> str:
    """`snapshot` in Prometheus' text format, with `trl_cb_info{info...} 1` (model, version, dtype) first."""
    lines = ["# HELP trl_cb_info The served model and trl_cb's version.", "# TYPE trl_cb_info gauge"]
    lines.append(f"trl_cb_info{_labels(info)} 1")
    for name, kind, help_text, samples in _SERIES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for labels, source in samples:
            value = source(snapshot) if callable(source) else snapshot[source]
            lines.append(f"{name}{_labels(labels)} {_number(value)}")
    return "\n".join(lines) + "\n"


def wants_json(accept: str | None) -> bool:
    """Whether a `GET /metrics` asked for the JSON object (`Accept: application/json`); anything else (a Prometheus
    scraper's `text/plain` or OpenMetrics, a browser's or curl's `*/*`, no header) gets the Prometheus text."""
    return "application/json" in (accept or "").lower()


def _labels(labels: dict[str, str]) -> str:
    """`{key="value",...}`, values escaped as the format requires (backslash, double quote, newline)."""
    if not labels:
        return ""
    return "{" + ",".join(f'{key}="{_escape(str(value))}"' for key, value in labels.items()) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return repr(float(value))
