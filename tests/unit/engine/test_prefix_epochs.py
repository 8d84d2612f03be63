"""Prefix reuse across turns (`engine/_upstream_prefix.py`) on a running engine with block sharing: a second turn
reuses the first turn's KV blocks while the weights are the same (exact against teacher forcing), and after a weight
update recomputes them (nothing matched, exact under the new weights). Control: without the epoch bump the same prompt
reuses the old weights' blocks and its logprobs are far from teacher forcing: the check would catch stale reuse."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import sampling_config
from tests.unit.rollouts.test_async import logprobs_of
from trl_cb import ContinuousBatchingGenerator
from trl_cb.engine import _upstream_prefix
from trl_cb.engine.sizing import Workload
from trl_cb.offline.data import synthetic_gsm8k
from trl_cb.offline.tiny import tiny_model
from trl_cb.rollouts.inflight_update import paused_for_weight_update
from trl_cb.rollouts.rollout_groups import InFlightGroups, RolloutGroup

NEW_TOKENS = 8


def perturb(model: torch.nn.Module, seed: int) -> None:
    """The same update on every copy (seeded noise)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))


def turn(groups: InFlightGroups, manager, prompt: list[int], version: int) -> tuple[list[int], torch.Tensor]:
    """One request run to its end: (ids, logprobs)."""
    group = RolloutGroup(row=object(), prompt_ids=prompt, submitted_version=version)
    groups.submit(manager, group, 1, NEW_TOKENS)
    while not groups.ready:
        groups.wait(manager, 0.05)
        groups.collect(manager)
    done = groups.ready.popleft()
    return list(done.completion_ids[0]), torch.tensor(done.logprobs[0])


@pytest.mark.parametrize("bump", [True, False], ids=["recompute-after-update", "control-no-epoch"])
def test_turns_reuse_blocks_only_under_the_weights_that_computed_them(tokenizer, monkeypatch, bump):
    model, reference = tiny_model(tokenizer, init_std=0.2), tiny_model(tokenizer, init_std=0.2)  # the same weights
    prompt = [t for row in synthetic_gsm8k(3, seed=1) for t in tokenizer(row["prompt"])["input_ids"]][:100]
    suffix = tokenizer.encode(" tool says 42.")
    matched: list[int] = []
    generator = ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=NEW_TOKENS))
    manager = generator.engine_for(model, Workload(2, 256, NEW_TOKENS, 256), share_prefixes=True)
    cache = manager.batch_processor.cache  # the engine's own matcher (`_upstream_patches` sets it on the instance)
    search = cache.search_prefix_match
    monkeypatch.setattr(cache, "search_prefix_match", lambda *a: matched.append(search(*a)) or matched[-1])
    groups = InFlightGroups()
    try:
        first, _ = turn(groups, manager, prompt, 0)
        second_prompt = prompt + first + suffix
        ids, logprobs = turn(groups, manager, second_prompt, 0)
        same_weights = (logprobs_of(reference, second_prompt, ids) - logprobs).abs().max().item()
        reused = matched[-1]
        with paused_for_weight_update(manager, groups, 1):
            perturb(model, seed=7)
            if bump:
                _upstream_prefix.bump_weight_epoch()
        perturb(reference, seed=7)
        ids, logprobs = turn(groups, manager, second_prompt, 1)
        after_update = (logprobs_of(reference, second_prompt, ids) - logprobs).abs().max().item()
    finally:
        generator.close()
    case = "epoch bumped" if bump else "control"
    print(f"\nsecond turn: {reused} of {len(second_prompt)} tokens reused, max|d| {same_weights:.2e}; after the "
          f"update ({case}): {matched[-1]} reused, max|d| {after_update:.2e}")  # fmt: skip
    assert reused >= 64 and same_weights <= 2e-5  # same weights: the first turn's blocks serve the second, exactly
    if bump:
        assert matched[-1] == 0 and after_update <= 2e-5
    else:
        assert matched[-1] >= 64 and after_update > 0.05
