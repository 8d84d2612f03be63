"""The `async/*` metrics of one `take`, defined once for every rollout backend (in-process engine or servers).

Why one builder: the engine and the server paths each computed their own metrics and two names drifted apart
(`tokens_per_s`, `engine_occupancy`). Now the async core alone builds them, from what every backend reports the same
way (a group submitted, a group finished), so a metric means the same whichever backend produced the groups.
Invariant: every name is emitted every step, zeros included (`AsyncMetrics.names()`), so dashboards have fixed
columns. Definitions: the `AsyncMetrics` docstring (and docs/async.md, "Metrics").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .rollout_groups import RolloutGroup, staleness

__all__ = ["STALENESS_BUCKETS", "AsyncMetrics", "TakeMeter"]

#: Histogram buckets: staleness 0..8 each, then one bucket for 9 and more (`async/staleness_hist/9+`).
STALENESS_BUCKETS = 10


def _bucket_name(index: int) -> str:
    return f"{index}+" if index == STALENESS_BUCKETS - 1 else str(index)


@dataclass
class AsyncMetrics:
    """One take's metrics; a group is *finished* once its backend reported all G samples done.

    - `queue_depth`: finished groups waiting in the queue after this take.
    - `inflight_groups`: groups submitted and not yet finished, after this take.
    - `wait_time_s`: seconds this take spent (waiting for groups included).
    - `staleness_mean`, `staleness_max`: `rollout_groups.staleness` of the groups this take returned.
    - `staleness_hist`: per bucket k (0..8, then 9+), how many of the returned groups have staleness k.
    - `dropped_groups`, `dropped_total`: groups dropped for staleness in this take / since the start.
    - `tokens_per_s`: completion tokens of the groups that finished since the previous take (or the start), divided
      by the seconds since then.
    - `engine_occupancy`: `inflight_groups / capacity_groups` (capacity: `(prefetch_depth + 1) * groups_per_step`).
    - `policy_version`: the trainer's weight version (updates or pushes so far).
    """

    queue_depth: int = 0
    inflight_groups: int = 0
    wait_time_s: float = 0.0
    staleness_mean: float = 0.0
    staleness_max: float = 0.0
    staleness_hist: list[int] = field(default_factory=lambda: [0] * STALENESS_BUCKETS)
    dropped_groups: int = 0
    dropped_total: int = 0
    tokens_per_s: float = 0.0
    engine_occupancy: float = 0.0
    policy_version: int = 0

    def as_dict(self, prefix: str = "async/") -> dict[str, float]:
        """Every metric as `prefix + name`; the histogram as `prefix + "staleness_hist/<bucket>"`."""
        out: dict[str, float] = {}
        for name, value in vars(self).items():
            if name == "staleness_hist":
                out.update({f"{prefix}{name}/{_bucket_name(k)}": float(c) for k, c in enumerate(value)})
            else:
                out[f"{prefix}{name}"] = float(value)
        return out

    @classmethod
    def names(cls, prefix: str = "async/") -> set[str]:
        """The names `as_dict` emits, every step."""
        return set(cls().as_dict(prefix))


class TakeMeter:
    """Accumulates what happens between two takes and builds each take's `AsyncMetrics`.

    `clock` is read once when the meter is made and twice per take (its start and its end), so a scripted clock makes
    the metrics exact in tests.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.dropped_total = 0
        self._since = clock()
        self._tokens = 0  # completion tokens of the groups finished since the previous take

    def finished(self, group: RolloutGroup) -> None:
        """`group` has all its samples (counted once, when its backend reports it)."""
        masks = group.tool_masks  # multi-turn: the model's tokens only
        self._tokens += sum(map(sum, masks)) if masks else sum(len(ids) for ids in group.completion_ids)

    def build(
        self,
        started: float,
        taken: list[RolloutGroup],
        dropped: int,
        policy_version: int,
        queue_depth: int,
        inflight_groups: int,
        capacity_groups: int,
    ) -> AsyncMetrics:
        """The metrics of the take that began at `started` (a `clock` reading) and returns `taken`."""
        now = self.clock()
        self.dropped_total += dropped
        ages = [staleness(group, policy_version) for group in taken]
        hist = [0] * STALENESS_BUCKETS
        for age in ages:
            hist[min(max(age, 0), STALENESS_BUCKETS - 1)] += 1
        metrics = AsyncMetrics(
            queue_depth=queue_depth,
            inflight_groups=inflight_groups,
            wait_time_s=now - started,
            staleness_mean=sum(ages) / len(ages) if ages else 0.0,
            staleness_max=max(ages, default=0),
            staleness_hist=hist,
            dropped_groups=dropped,
            dropped_total=self.dropped_total,
            tokens_per_s=self._tokens / max(now - self._since, 1e-9),
            engine_occupancy=inflight_groups / max(capacity_groups, 1),
            policy_version=policy_version,
        )
        self._since, self._tokens = now, 0
        return metrics
