"""`RemoteRolloutController` (the async core on `ServerBackend`) against a scripted client (no server): FIFO whatever
the finishing order, staleness drops counted in the resume position, weight pushes, errors and timeouts reaching the
trainer."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from trl_cb.errors import RolloutServerError
from trl_cb.serving.client import RemoteGenerationResult
from trl_cb.serving.remote_rollouts import RemoteRolloutController


class ScriptedClient:
    """Answers prompt `[i]` after `delay(i)` seconds (from the start of its stream) with `n` one-token completions of
    the current `version`; groups of one stream are delivered in order of their delays (finishing order)."""

    def __init__(self, delay=lambda i: 0.0, fail_on: int | None = None, urls=("http://a",)) -> None:
        self.delay = delay
        self.fail_on = fail_on
        self.urls = list(urls)
        self.version = 0
        self.calls: list[int] = []
        self.streams: list[int] = []  # groups per streaming call
        self.delivered: set[int] = set()  # prompts answered
        self._lock = threading.Lock()

    def stream_generate(self, prompts, n, on_group, preferred=0, **sampling) -> None:
        with self._lock:
            self.streams.append(len(prompts))
        started = time.monotonic()
        for j in sorted(range(len(prompts)), key=lambda j: self.delay(prompts[j][0])):
            (i,) = prompts[j]
            with self._lock:
                self.calls.append(i)
            time.sleep(max(0.0, self.delay(i) - (time.monotonic() - started)))
            if i == self.fail_on:
                raise RolloutServerError("replica gone")
            version = self.version
            on_group(
                j,
                RemoteGenerationResult(
                    completion_ids=[[i]] * n,
                    logprobs=[[-1.0]] * n,
                    policy_logprobs=[[-1.0]] * n,
                    weight_versions=[version] * n,
                    token_weight_versions=[[version]] * n,
                    num_generations=n,
                ),
            )
            with self._lock:
                self.delivered.add(i)


def controller(client: ScriptedClient, **kwargs) -> RemoteRolloutController:
    stream = ((f"row{i}", [i]) for i in itertools.count())
    options = {"num_generations": 2, "groups_per_step": 2, "sampling": {"max_tokens": 1}}
    return RemoteRolloutController(client, stream, **{**options, **kwargs})


def push(ctl: RemoteRolloutController, client: ScriptedClient) -> None:
    """What the trainer does around a push: the servers serve a new version, the controller is told."""
    client.version += 1
    ctl.weights_pushed(client.version)


def started(client: ScriptedClient, **kwargs) -> RemoteRolloutController:
    """A controller started as the trainer starts it: the first push (version 1) before any request."""
    ctl = controller(client, **kwargs)
    client.version += 1
    ctl.start(client.version)
    return ctl


def test_groups_come_back_in_request_order_whatever_finishes_first():
    client = ScriptedClient(delay=lambda i: 0.2 if i % 4 == 0 else 0.0)  # every 4th request is the slowest
    ctl = started(client, prefetch_depth=1, max_staleness=5)
    assert ctl.policy_version == 1, "requests start at the version pushed before them"
    seen = []
    for _ in range(3):
        groups, metrics = ctl.take(2)
        seen += [g.row for g in groups]
        assert all(g.completion_ids == [[int(g.row[3:])]] * 2 for g in groups)
    assert seen == [f"row{i}" for i in range(6)] and ctl.consumed_groups == 6
    assert metrics.policy_version == 1 and metrics.dropped_total == 0
    assert len(client.calls) >= 6 and ctl.outstanding_groups == ctl.capacity_groups == 4, "kept full, never more"


def answered(client: ScriptedClient, count: int, timeout: float = 30.0) -> None:
    """Wait until the first `count` requested groups have their answers (not a sleep: a loaded machine may take
    longer to run the request threads than any fixed pause)."""
    deadline = time.monotonic() + timeout
    while not set(range(count)) <= client.delivered:
        assert time.monotonic() < deadline, f"{count} groups not answered within {timeout} s"
        time.sleep(0.005)


def test_stale_groups_are_dropped_and_counted_in_the_resume_position():
    client = ScriptedClient()
    ctl = started(client, prefetch_depth=1, max_staleness=1)
    answered(client, 4)  # the first 4 groups are sampled with version 1
    for _ in range(2):  # two optimizer steps: version 3, those groups are 2 updates old
        push(ctl, client)
    groups, metrics = ctl.take(2)
    assert metrics.dropped_groups == 4 and metrics.staleness_max == 0
    assert [g.row for g in groups] == ["row4", "row5"] and ctl.consumed_groups == 6
    assert all(v == [[3], [3]] for v in (g.versions for g in groups))


def test_keep_stale_keeps_them():
    client = ScriptedClient()
    ctl = started(client, prefetch_depth=1, max_staleness=0, keep_stale=True)
    answered(client, 4)
    push(ctl, client)
    groups, metrics = ctl.take(2)
    assert [g.row for g in groups] == ["row0", "row1"] and metrics.staleness_max == 1 and metrics.dropped_total == 0


def test_a_failed_group_raises_in_the_trainer():
    ctl = started(ScriptedClient(fail_on=1))
    with pytest.raises(RolloutServerError, match="replica gone"):
        ctl.take(2)


def test_take_times_out_instead_of_hanging():
    ctl = started(ScriptedClient(delay=lambda i: 5.0), timeout=0.3)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="No rollouts within 0.3 s"):
        ctl.take(2)
    assert time.monotonic() - start < 1.0
    ctl.stop()


def test_invalid_prompt_names_its_stream_item():
    def validate(prompt: list[int]) -> None:
        if prompt == [2]:
            raise ValueError("too long")

    with pytest.raises(ValueError, match="item 2: too long"):
        started(ScriptedClient(), validate=validate, prefetch_depth=1)


def _wait_for(condition, timeout: float = 60.0) -> None:
    """Poll `condition` (a hang guard only: the work it waits for is bounded)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached within the hang guard"
        time.sleep(0.01)


def test_threads_are_o_replicas_not_o_groups():
    """1,024 groups in flight from 2 replicas: 2 x `streams_per_replica` worker threads, a handful of streaming
    requests (not one per group), every group handed out once, in request order."""
    client = ScriptedClient(urls=("http://a", "http://b"))
    before = threading.active_count()

    def slow_submitter(prompt: list[int]) -> None:  # a loaded trainer thread: idle workers see each group alone
        if prompt[0] < 16:
            time.sleep(0.005)

    ctl = started(
        client, groups_per_step=512, prefetch_depth=1, max_staleness=5, streams_per_replica=2, validate=slow_submitter
    )
    assert ctl.capacity_groups == 1024 and len(ctl.server_backend.workers) == 4
    assert threading.active_count() - before <= 4
    _wait_for(lambda: len(client.delivered) == 1024)  # the whole window answered: the take below hands out 512 at once
    assert sorted(client.streams) == [256] * 4  # a full window spread over the 4 workers, whatever the timing
    groups, _ = ctl.take(512)
    assert [g.row for g in groups] == [f"row{i}" for i in range(512)]
    _wait_for(lambda: sum(client.streams) == 1536)
    assert sorted(client.streams) == [256] * 6  # the top-up of 512: one batch per replica
    ctl.stop()
