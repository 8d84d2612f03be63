"""The reference a hybrid model's engine logprobs are checked against: transformers' own cached computation of the
same tokens, in the same segments, with the weights each segment ran with.

Why not teacher forcing alone: a Gated DeltaNet layer computes a prefill with its chunked kernel and a decode step
with its recurrent one, both in fp32 whatever the model's dtype, and on weights far from uniform the two differ by
1e-5 to 1e-4 nats (transformers' own `generate()` differs from the teacher-forced forward by as much: measured in
tests/unit/engine/test_hybrid_engine.py). An exact engine reproduces the cached computation, so it is checked
against one: every request's recorded segments (`StepTrace`: each engine step's prefill chunks and decode tokens, as
the step plan mapped them) replayed through the model with a `DynamicCache`, in float64 so that the only rounding
left is the kernels' own fp32 and the sampler's fp32 logits (~1e-6).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from trl_cb.engine import _upstream_recurrent


@dataclass(frozen=True)
class Segment:
    """Tokens `[past, past + length)` of one request, run in one engine step with weights `version`."""

    past: int
    length: int
    version: int
    step: int


@dataclass
class StepTrace:
    """Every engine step's segments per request id, recorded from the step plan (`RecurrentStepper.plan_step`)."""

    segments: dict[str, list[Segment]] = field(default_factory=lambda: defaultdict(list))
    steps: list[list[tuple[str, int, int]]] = field(default_factory=list)  # per step: (request id, past, length)
    prompts: dict[str, tuple[int, ...]] = field(default_factory=dict)  # request id -> its prompt
    #: per step with decode rows: whether they ran on views of consecutive slots (else gathered and scattered)
    decode_on_views: list[bool] = field(default_factory=list)
    version: int = 0  # weights version the next steps run with (bumped by the test around a weight update)
    on_step: Callable[[int], None] | None = None  # called on the engine thread before each step's forward

    def install(self, monkeypatch) -> StepTrace:
        plan_step = _upstream_recurrent.RecurrentStepper.plan_step
        trace = self

        def recording_plan_step(stepper: _upstream_recurrent.RecurrentStepper, requests: Sequence) -> None:
            step = len(trace.steps)
            if trace.on_step is not None:
                trace.on_step(step)
            rows = []
            for future in requests:
                past = future.state.position_offset - future.query_length
                rid = future.state.request_id
                trace.segments[rid].append(Segment(past, future.query_length, trace.version, step))
                trace.prompts.setdefault(rid, tuple(future.state.initial_tokens))
                rows.append((rid, past, future.query_length))
            trace.steps.append(rows)
            plan_step(stepper, requests)
            if stepper._plan.decode_slots is not None:
                trace.decode_on_views.append(stepper._plan.decode_span is not None)

        monkeypatch.setattr(_upstream_recurrent.RecurrentStepper, "plan_step", recording_plan_step)
        return self

    def clear(self) -> None:
        self.segments.clear()
        self.steps.clear()
        self.prompts.clear()
        self.decode_on_views.clear()

    def group_request_ids(self, prompt: Sequence[int], completions: Sequence[Sequence[int]]) -> list[str]:
        """The request ids of one prompt's samples (source first, then its forks, the engine's order), found by the
        prompt and by each sample's length: for groups submitted by other code than the generator (async rollouts)."""
        for rid, seen in self.prompts.items():
            ids = [rid] + [f"{rid}__child#{i}" for i in range(len(completions) - 1)]
            if "__child#" in rid or seen != tuple(prompt) or any(i not in self.segments for i in ids):
                continue
            ends = [sum(s.length for s in self.of(i)) for i in ids]
            if ends == [len(prompt) + len(c) - 1 for c in completions]:
                return ids
        raise AssertionError(f"no traced request has this prompt and these lengths: {[len(c) for c in completions]}")

    def of(self, request_id: str) -> list[Segment]:
        """A sequence's segments from its first token: a forked sample's are its source's up to the fork, then its
        own (transformers names them `<source>__child#<i>`)."""
        own = self.segments[request_id]
        if "__child#" not in request_id:
            return list(own)
        source = self.segments[request_id.split("__child#")[0]]
        return [s for s in source if s.past < own[0].past] + list(own)


def request_ids(round_index: int, num_prompts: int, num_generations: int) -> list[str]:
    """The engine request ids of a generator round's completions, in the caller's order (`_submit`, `_assemble`)."""
    ids = []
    for p in range(num_prompts):
        parent = f"r{round_index}_p{p}"
        ids += [parent] + [f"{parent}__child#{c}" for c in range(num_generations - 1)]
    return ids


@torch.no_grad()
def replay_logprobs(
    models: dict[int, torch.nn.Module] | torch.nn.Module,
    segments: Sequence[Segment],
    sequence: Sequence[int],
    prompt_len: int,
    temperature: float,
) -> torch.Tensor:
    """float64 logprobs of `sequence[prompt_len:]` computed segment by segment with a `DynamicCache`, each segment
    by the weights of its version (`models[version]`): what an exact engine samples them with."""
    by_version = models if isinstance(models, dict) else {segment.version: models for segment in segments}
    config = next(iter(by_version.values())).config
    cache = DynamicCache(config=config)
    found: dict[int, float] = {}
    expected = 0
    for segment in segments:
        assert segment.past == expected, f"segments are not contiguous: {segments}"
        expected = segment.past + segment.length
        tokens = torch.tensor([list(sequence[segment.past : expected])])
        logits = by_version[segment.version](tokens, cache=cache, use_cache=True).logits[0, -1].double()
        if prompt_len <= expected < len(sequence):
            found[expected] = torch.log_softmax(logits / temperature, -1)[sequence[expected]].item()
    missing = [p for p in range(prompt_len, len(sequence)) if p not in found]
    assert not missing, f"no segment ends before positions {missing}"
    return torch.tensor([found[p] for p in range(prompt_len, len(sequence))], dtype=torch.float64)
