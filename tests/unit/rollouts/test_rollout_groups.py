"""`InFlightGroups` per-token versions across a weight update, with a scripted engine (no model): the case where a
request finished just before the pause, its result still in the engine's output queue."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

from trl_cb.rollouts.rollout_groups import InFlightGroups, RolloutGroup


@dataclass
class Result:
    request_id: str
    generated_tokens: list[int]
    error: None = None
    logprobs: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.logprobs = [-1.0] * len(self.generated_tokens)

    def is_finished(self) -> bool:
        return True


class ScriptedEngine:
    """The manager surface `InFlightGroups` touches: requests, the output queue, the scheduler's in-flight states."""

    def __init__(self) -> None:
        self.num_return_sequences = 1
        self.outputs: deque[Result] = deque()
        self.batch_processor = SimpleNamespace(scheduler=SimpleNamespace(waiting_requests={}, active_requests={}))

    def add_request(self, input_ids: list[int], request_id: str, max_new_tokens: int) -> str:
        return request_id

    def get_result(self, timeout: float | None = None) -> Result | None:
        return self.outputs.popleft() if self.outputs else None

    def running(self, request_id: str, generated: int) -> None:
        self.batch_processor.scheduler.active_requests[request_id] = SimpleNamespace(generated_tokens=[0] * generated)

    def finish(self, request_id: str, tokens: int) -> None:
        self.batch_processor.scheduler.active_requests.pop(request_id, None)
        self.outputs.append(Result(request_id, list(range(tokens))))


def test_a_request_finished_before_the_pause_keeps_its_old_version():
    engine, groups = ScriptedEngine(), InFlightGroups()
    groups.submit(engine, RolloutGroup(row="done-before", prompt_ids=[5, 6]), 1, 8)
    groups.submit(engine, RolloutGroup(row="straddles", prompt_ids=[7, 8]), 1, 8)
    engine.finish("a0", 3)  # finished before the pause: out of the scheduler, result not collected yet
    engine.running("a1", 2)  # 2 tokens so far
    groups.mark_weight_update(engine, new_version=1)
    engine.finish("a1", 4)
    groups.collect(engine)
    versions = {group.row: group.versions[0] for group in groups.ready}
    assert versions == {"done-before": [0, 0, 0], "straddles": [0, 0, 1, 1]}
