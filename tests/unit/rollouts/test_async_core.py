"""The async core (`rollouts/async_core.py`) on scripted backends, no model: the same scripted groups give the same
`async/*` metrics whichever backend shape delivers them (the engine's, in order; the servers', any order), FIFO and
exactly once, the staleness rule and its histogram, and every name every step."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from tests.unit.serving.test_remote_rollouts import ScriptedClient
from trl_cb.rollouts.async_core import AsyncRollouts, RolloutBackend
from trl_cb.rollouts.async_metrics import STALENESS_BUCKETS, AsyncMetrics
from trl_cb.rollouts.rollout_groups import RolloutGroup, oldest_version, staleness
from trl_cb.serving.remote_rollouts import ServerBackend


class ScriptedBackend(RolloutBackend):
    """Finishes the submitted groups `per_poll` at a time, each prompt `[i]` with `i % 3 + 1` tokens per sample at
    version `version_of(i)`. `reverse`: the servers' shape, the later of two groups reported first."""

    def __init__(self, version_of: dict[int, int], per_poll: int = 2, reverse: bool = False) -> None:
        self.version_of = version_of
        self.per_poll = per_poll
        self.reverse = reverse
        self.submitted: list[RolloutGroup] = []
        self.capacity = 0

    def start(self, capacity_groups: int) -> None:
        self.capacity = capacity_groups

    def submit(self, group: RolloutGroup) -> None:
        self.submitted.append(group)

    def poll(self, timeout: float) -> list[RolloutGroup]:
        batch, self.submitted = self.submitted[: self.per_poll], self.submitted[self.per_poll :]
        for group in batch:
            (i,) = group.prompt_ids
            tokens = i % 3 + 1
            group.completion_ids = [[i] * tokens] * 2
            group.versions = [[self.version_of.get(i, group.submitted_version)] * tokens] * 2
        return batch[::-1] if self.reverse else batch

    def stop(self) -> None:
        self.submitted.clear()


def ticking_clock() -> Iterator[float]:
    return itertools.count(0.0, 0.5)


def scripted_run(backend: RolloutBackend) -> list[dict[str, float]]:
    """Three takes of 2 groups with a weight update between takes; prompts 0-3 were sampled long ago (version -9)."""
    clock = ticking_clock()
    stream = ((f"row{i}", [i]) for i in itertools.count())
    core = AsyncRollouts(backend, stream, 2, 2, prefetch_depth=1, max_staleness=3, clock=lambda: next(clock))
    core.start()
    logs = []
    for _ in range(3):
        groups, metrics = core.take(2)
        logs.append(metrics.as_dict())
        with core.weight_update():
            pass
    core.stop()
    return logs


def test_the_same_groups_give_the_same_metrics_through_either_backend_shape():
    versions = {0: -9, 1: 0, 2: 0, 3: 0}
    in_order = scripted_run(ScriptedBackend(versions))
    any_order = scripted_run(ScriptedBackend(versions, reverse=True))
    assert in_order == any_order
    first = in_order[0]
    # take 1: row0 is 9 updates old (dropped: not in the histogram), rows 1 and 2 are taken at staleness 0
    assert first["async/dropped_groups"] == 1 and first["async/staleness_hist/0"] == 2
    assert first["async/staleness_hist/9+"] == 0
    # 2 polls of 2 groups finished: rows 0-3, 2 * (1 + 2 + 3 + 1) tokens over 1.0 s (clock: 0.0 at start, 1.0 at end)
    assert first["async/tokens_per_s"] == 14.0 and first["async/wait_time_s"] == 0.5
    assert first["async/queue_depth"] == 1 and first["async/inflight_groups"] == 3
    assert first["async/engine_occupancy"] == 3 / 4
    assert in_order[1]["async/policy_version"] == 1 and in_order[1]["async/staleness_hist/1"] == 2


def test_every_name_every_step_with_a_bucket_per_staleness():
    names = AsyncMetrics.names()
    assert {f"async/staleness_hist/{k}" for k in range(9)} | {"async/staleness_hist/9+"} <= names
    assert len([n for n in names if "staleness_hist" in n]) == STALENESS_BUCKETS
    assert all(set(log) == names for log in scripted_run(ScriptedBackend({})))


def test_keep_stale_counts_old_groups_in_the_last_bucket():
    clock = ticking_clock()
    stream = ((f"row{i}", [i]) for i in itertools.count())
    backend = ScriptedBackend({0: -20, 1: -5})
    core = AsyncRollouts(backend, stream, 2, 2, max_staleness=0, keep_stale=True, clock=lambda: next(clock))
    core.start()
    groups, metrics = core.take(2)
    hist = metrics.as_dict()
    assert [g.row for g in groups] == ["row0", "row1"] and metrics.dropped_total == 0
    assert hist["async/staleness_hist/9+"] == 1 and hist["async/staleness_hist/5"] == 1
    assert metrics.staleness_max == 20 and core.consumed_groups == 2


def test_fifo_exactly_once_and_bounded_with_groups_finishing_in_reverse():
    stream = ((f"row{i}", [i]) for i in itertools.count())
    backend = ScriptedBackend({}, per_poll=3, reverse=True)
    core = AsyncRollouts(backend, stream, 2, 3, prefetch_depth=2)
    core.start()
    seen = []
    for _ in range(4):
        groups, _ = core.take(3)
        seen += [g.row for g in groups]
        assert core.outstanding_groups <= core.capacity_groups == 9
    assert seen == [f"row{i}" for i in range(12)] and core.consumed_groups == 12


def test_one_staleness_rule_and_one_oldest_version():
    group = RolloutGroup(row=None, prompt_ids=[1], versions=[[3, 3, 4], [2, 5]], submitted_version=2)
    assert group.oldest_version == oldest_version(group.versions, 2) == 2
    assert staleness(group, 5) == 3
    assert oldest_version([[]], default=7) == 7  # nothing sampled yet: the version at submission


def test_prompt_validation_names_the_stream_item():
    class Refusing(ScriptedBackend):
        def validate(self, prompt_ids: list[int]) -> None:
            if prompt_ids == [3]:
                raise ValueError("too long")

    stream = ((f"row{i}", [i]) for i in itertools.count())
    core = AsyncRollouts(Refusing({}), stream, 2, 2)
    with pytest.raises(ValueError, match="Async prompt stream item 3: too long"):
        core.start()


def test_server_backend_reports_each_group_once():
    """The real `ServerBackend` on a scripted client: every submitted group comes back from `poll`, once."""
    backend = ServerBackend(ScriptedClient(), num_generations=2, sampling={})
    backend.start(capacity_groups=4)
    groups = [RolloutGroup(row=i, prompt_ids=[i]) for i in range(4)]
    for group in groups:
        backend.submit(group)
    backend.flush()  # the core flushes after each top-up
    finished: list[RolloutGroup] = []
    for _ in range(200):
        finished += backend.poll(0.05)
        if len(finished) == 4:
            break
    backend.stop()
    assert sorted(g.row for g in finished) == [0, 1, 2, 3]
    assert all(g.completion_ids == [[g.row]] * 2 for g in finished)
