"""The overlap engine's own CUDA stream (trl_cb/engine/engine_stream.py), checked on CPU with a recording fake of
torch's stream API and, where a CUDA device exists, on the device.

The fake logs every `wait_stream`, `synchronize` and stream entry, and a forward pre-hook on the view logs each engine
forward with the stream current on its thread; `ordering_violations` states the invariants of engine_stream.py's
docstring over that log. Control: with the two waits of an optimizer step disabled, the same log is rejected.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
from collections.abc import Iterator

import pytest
import torch

from tests.conftest import sampling_config
from tests.gates import engine_throttle
from tests.unit.rollouts.test_overlap import (
    CONTROL_GAP,
    engine_threads,
    overlap_controller,
    perturb,
    sharp_model,
    version_gaps,
)
from trl_cb import ContinuousBatchingGenerator
from trl_cb.engine import engine_stream
from trl_cb.engine.engine_stream import EngineStream
from trl_cb.offline.data import synthetic_gsm8k
from trl_cb.rollouts.async_controller import AsyncRolloutController


class FakeStream:
    def __init__(self, log: list[tuple], name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait", self.name, other.name))

    def synchronize(self) -> None:
        self.log.append(("sync", self.name))


class FakeCuda:
    """`Stream`, `current_stream` and `stream` as torch.cuda has them, per thread, logging into `log`."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.trainer = FakeStream(self.log, "T")
        self.created: list[tuple[FakeStream, torch.device]] = []
        self._local = threading.local()

    def Stream(self, device: torch.device) -> FakeStream:  # noqa: N802 - torch's name
        stream = FakeStream(self.log, "E")
        self.created.append((stream, device))
        return stream

    def current_stream(self, device: torch.device | None = None) -> FakeStream:
        return getattr(self._local, "stream", self.trainer)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        previous = self.current_stream()
        self._local.stream = stream
        self.log.append(("enter", stream.name, threading.current_thread() is threading.main_thread()))
        try:
            yield
        finally:
            self._local.stream = previous


def ordering_violations(log: list[tuple]) -> list[str]:
    """Each breach of engine_stream.py's invariants in `log` (events: wait, sync, enter, forward, write, close)."""
    bad = []
    forwards = [i for i, e in enumerate(log) if e[0] == "forward"]
    if not forwards:
        return ["no engine forward"]
    if any(log[i][1] != "E" or log[i][2] for i in forwards):
        bad.append("an engine forward ran off the engine stream or on the trainer's thread")
    if [e for e in log if e[0] == "enter"] != [("enter", "E", False)]:
        bad.append("the engine loop did not enter E exactly once, on its own thread")
    if ("wait", "E", "T") not in log[: forwards[0]]:
        bad.append("the first engine step does not wait for the trainer's stream")
    for w in (i for i, e in enumerate(log) if e[0] == "write"):
        last_forward = max((i for i in forwards if i < w), default=-1)
        if ("wait", "T", "E") not in log[last_forward + 1 : w]:
            bad.append(f"write at {w}: the trainer's stream did not wait for the engine's before it")
        next_forward = min((i for i in forwards if i > w), default=len(log))
        if ("wait", "E", "T") not in log[w + 1 : next_forward]:
            bad.append(f"write at {w}: the engine's next step does not wait for the trainer's stream")
    close = next((i for i, e in enumerate(log) if e[0] == "close"), None)
    if close is None or ("sync", "E") not in log[forwards[-1] : close]:
        bad.append("the engine stream is not synchronised between its last step and the release of its memory")
    return bad


@pytest.mark.parametrize("broken", [False, True], ids=["ordered", "control-no-waits"])
def test_engine_steps_run_on_their_own_stream_ordered_around_weight_writes(tokenizer, monkeypatch, broken):
    fake = FakeCuda()
    monkeypatch.setattr(engine_stream, "_cuda", fake)
    monkeypatch.setattr(EngineStream, "for_device", classmethod(lambda cls, device: cls(device)))  # as on CUDA
    if broken:
        monkeypatch.setattr(EngineStream, "before_weight_write", lambda self: None)
        monkeypatch.setattr(EngineStream, "after_weight_write", lambda self: None)
    model = sharp_model(tokenizer)
    ctl = overlap_controller(model, tokenizer, max_new_tokens=64)
    real_close = ctl.generator.close
    monkeypatch.setattr(ctl.generator, "close", lambda: (fake.log.append(("close",)), real_close())[1])
    view = ctl.backend.view.module
    view.get_input_embeddings().register_forward_pre_hook(
        lambda *_: fake.log.append(
            ("forward", fake.current_stream().name, threading.current_thread() is threading.main_thread())
        )
    )
    noise = torch.Generator().manual_seed(0)
    try:
        with engine_throttle(view, monkeypatch) as throttle:
            for _ in range(3):
                throttle.step(2)
                with ctl.weight_update():
                    fake.log.append(("write",))
                    perturb(model, noise)
            throttle.step(2)
    finally:
        ctl.stop()
    assert len(fake.created) == 1 and fake.created[0][1] == view.device, (
        "one stream per backend, on the model's device"
    )
    assert not engine_threads()
    violations = ordering_violations(fake.log)
    if broken:
        assert any("write at" in v for v in violations), violations
    else:
        assert violations == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_runs_on_its_stream_and_matches_each_version(tokenizer, monkeypatch):
    """On CUDA, synchronous engine: the engine's forwards run on the backend's stream (the batch processor's compute
    stream is that stream), never the trainer's; three updates land while requests generate and every token still
    matches teacher forcing under its recorded version (fp32 on the device against fp32 on CPU). Control: the old
    weights miss."""
    model = sharp_model(tokenizer).to("cuda")
    models = {0: copy.deepcopy(model).cpu()}
    rows = synthetic_gsm8k(40, seed=4)
    stream_of_prompts = ((r, tokenizer(r["prompt"])["input_ids"]) for r in itertools.cycle(rows))
    # Synchronous engine: every step runs the view's Python forward (the throttle's hook; graph replays skip hooks).
    sync_engine = {"use_cuda_graph": False, "use_async_batching": False}
    generator = ContinuousBatchingGenerator(
        model, sampling_config(tokenizer, max_new_tokens=64), continuous_batching_config=sync_engine
    )
    ctl = AsyncRolloutController(
        generator, model, stream_of_prompts, max_prompt_len=64, overlap=True, num_generations=2, groups_per_step=2,
        prefetch_depth=2, max_staleness=1, keep_stale=True,
    )  # fmt: skip
    ctl.start()
    stream = ctl.backend.stream
    seen: list[bool] = []
    view = ctl.backend.view.module
    view.get_input_embeddings().register_forward_pre_hook(
        lambda *_: seen.append(torch.cuda.current_stream() == stream.stream)
    )
    noise = torch.Generator(device="cuda").manual_seed(0)
    try:
        assert (
            stream is not None
            and ctl.backend.manager.batch_processor.inputs_and_outputs.compute_stream is stream.stream
        )
        with engine_throttle(view, monkeypatch) as throttle:
            for version in range(1, 4):
                throttle.step(3)
                with ctl.weight_update():
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(0.05 * torch.randn(p.shape, generator=noise, device="cuda"))
                models[version] = copy.deepcopy(model).cpu()
            throttle.open()
            groups = [g for _ in range(3) for g in ctl.take(2)[0]]
    finally:
        ctl.stop()
    assert seen and all(seen) and torch.cuda.current_stream() != stream.stream
    gaps, controls, straddled = version_gaps(models, groups)
    assert len(straddled) >= 2 and max(gaps) <= 1e-3 and min(controls) > CONTROL_GAP, (straddled, max(gaps))
