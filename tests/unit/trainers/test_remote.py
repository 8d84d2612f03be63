"""`trainers/remote.py` on two real processes (gloo, accelerate's `PartialState`), with a fake rollout client.

Every rank gets the completions of its own prompts, also with unequal prompt counts, from one request the main
process makes; only the main process holds a client; a failure on the main process is raised on every rank (no rank
left waiting in a collective). The end-to-end runs against a real server are in
tests/distributed/test_server_distributed.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from transformers import GenerationConfig

from tests.gloo_workers import run_two_workers
from trl_cb.errors import RolloutServerError
from trl_cb.serving.client import RemoteGenerationResult
from trl_cb.trainers.remote import RemoteRollouts


class FakeClient:
    """Completion of prompt p: p reversed; logprobs: -len(p). Counts requests; fails on demand."""

    def __init__(self) -> None:
        self.requests: list[int] = []
        self.fail = False

    def generate(self, prompts: list[list[int]], n: int, **sampling: Any) -> RemoteGenerationResult:
        if self.fail:
            raise RolloutServerError("no rollout server could serve the request (fake)")
        self.requests.append(len(prompts))
        ids = [p[::-1] for p in prompts]
        logprobs = [[-float(len(p))] * len(p) for p in prompts]
        versions = [[0] * len(p) for p in prompts]
        return RemoteGenerationResult(
            completion_ids=ids,
            logprobs=logprobs,
            policy_logprobs=logprobs,
            weight_versions=[0] * len(prompts),
            token_weight_versions=versions,
            num_generations=n,
        )


class FakeTrainer:
    """What `RemoteRollouts` reads of a trainer, with its rollouts connected and the weights current."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.args = SimpleNamespace(report_to=[], cb_async_generation=False)
        self.state = SimpleNamespace(global_step=0)
        self.generation_config = GenerationConfig(max_new_tokens=4)
        self.rollouts = SimpleNamespace(remote=RemoteRollouts(self))
        remote = self.rollouts.remote
        remote.connected, remote.pushed_step = True, 0  # connected, weights current: generation only
        remote.client = FakeClient() if accelerator.is_main_process else None


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    from accelerate import PartialState

    state = PartialState(cpu=True)
    try:
        trainer = FakeTrainer(state)
        prompts = [[rank * 10 + i, 1, 2 + i] for i in range(3 - rank)]  # rank 0: 3 prompts, rank 1: 2
        ids, logprobs = trainer.rollouts.remote.generate(prompts)
        report: dict[str, Any] = {
            "own": ids == [p[::-1] for p in prompts] and logprobs == [[-3.0] * 3] * len(prompts),
            "requests": trainer.rollouts.remote.client.requests if trainer.rollouts.remote.client else None,
        }
        if trainer.rollouts.remote.client is not None:
            trainer.rollouts.remote.client.fail = True
        try:
            trainer.rollouts.remote.generate(prompts)
            report["raised"] = None
        except RolloutServerError as exc:
            report["raised"] = str(exc)
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
        state.wait_for_everyone()
    finally:
        # Both ranks leave the group before the interpreter exits: a rank that exits while the other still tears
        # down its gloo/TCPStore threads aborts ("terminate called without an active exception", SIGABRT; seen
        # once in three full runs).
        state.destroy_process_group()


def test_main_process_generates_for_every_rank(tmp_path):
    run_two_workers(_worker, tmp_path, "remote generation")
    main, other = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert main["own"] and other["own"], "each rank gets its own prompts' completions, in order"
    assert main["requests"] == [5] and other["requests"] is None, "one request for both ranks, from the main process"
    assert "fake" in main["raised"], main
    assert "main process failed" in other["raised"] and "fake" in other["raised"], other
