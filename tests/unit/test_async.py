"""Async rollouts (trl_cb/async_rollouts.py): staleness, versions, behaviour logprobs across updates, lifecycle."""

from __future__ import annotations

import copy
import itertools
import math
import time

import pytest
import torch

from tests.conftest import sampling_config
from tests.unit.test_trainers import make_trainer
from trl_cb import ContinuousBatchingGenerator, EngineDiedError, GenerationError, GRPOConfig
from trl_cb.async_rollouts import AsyncMetrics, AsyncRolloutController
from trl_cb.data import synthetic_gsm8k


def controller(model, tokenizer, max_new_tokens=24, cb=None, **kwargs) -> AsyncRolloutController:
    rows = synthetic_gsm8k(40, seed=4)
    stream = ((r, tokenizer(r["prompt"])["input_ids"]) for r in itertools.cycle(rows))
    gen = ContinuousBatchingGenerator(model, sampling_config(tokenizer, max_new_tokens=max_new_tokens), cb)
    options = dict(num_generations=2, groups_per_step=2, prefetch_depth=1, max_staleness=1)
    options.update(kwargs)
    ctl = AsyncRolloutController(gen, model, stream, **options)
    ctl.start(max_prompt_len=64)
    return ctl


def perturb(model: torch.nn.Module, scale: float = 0.05) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def logprobs_of(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Teacher-forced logprobs of `tokens` after `prompt` under `model`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def partial_rollout_logprobs(old, new, prompt: list[int], tokens: list[int], b: int) -> torch.Tensor:
    """Logprobs of `tokens[b:]` when the update came after `tokens[:b]` were sampled: the KV of the prompt and of
    `tokens[:b-1]` was computed by `old`; `new` then feeds `tokens[b-1:]` on top of that cache."""
    with torch.no_grad():
        cache = old(torch.tensor([prompt + tokens[: b - 1]]), use_cache=True).past_key_values
        logits = new(torch.tensor([tokens[b - 1 : -1]]), past_key_values=cache, use_cache=True).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[b:])[:, None])[:, 0]


def test_groups_intact_metrics_complete_and_fifo(model, tokenizer):
    ctl = controller(model, tokenizer)
    try:
        order = []
        for _ in range(3):
            groups, metrics = ctl.take(2)
            assert set(metrics.as_dict()) == {f"async/{k}" for k in vars(AsyncMetrics())}  # every name, every step
            for g in groups:
                assert len(g.completion_ids) == len(g.logprobs) == len(g.versions) == 2
                assert all(len(c) == len(lp) == len(v) for c, lp, v in zip(g.completion_ids, g.logprobs, g.versions))
                order.append(g.row["prompt"])
        rows = [r["prompt"] for r in synthetic_gsm8k(40, seed=4)]
        assert order == rows[: len(order)], "groups must come back in submission order"
    finally:
        ctl.stop()


def test_staleness_bound_enforced_and_drops_counted(model, tokenizer):
    ctl = controller(model, tokenizer, max_staleness=0, prefetch_depth=2)
    try:
        total_dropped = 0
        for _ in range(4):
            groups, metrics = ctl.take(2)
            assert all(ctl.policy_version - g.oldest_version <= 0 for g in groups)
            assert metrics.staleness_max == 0
            total_dropped += metrics.dropped_groups
            assert metrics.dropped_total == total_dropped
            with ctl.weight_update():
                perturb(model, 0.0)
        assert total_dropped > 0, "prefetched groups from older versions must have been dropped"
    finally:
        ctl.stop()


def test_keep_stale_keeps_and_reports(model, tokenizer):
    ctl = controller(model, tokenizer, max_staleness=0, prefetch_depth=2, keep_stale=True)
    try:
        ctl.take(2)
        with ctl.weight_update():
            pass
        _, metrics = ctl.take(2)
        assert metrics.dropped_groups == 0 and metrics.staleness_max >= 1
    finally:
        ctl.stop()


def test_behaviour_logprobs_across_a_weight_update(tokenizer):
    """A completion that straddles an update: tokens sampled before it match the old weights; tokens after it
    match the new weights on top of the KV cache computed with the old ones (partial-rollout semantics). The
    recorded logprobs are what IS must use: they differ from any single-policy recomputation."""
    from trl_cb.tiny import tiny_model

    model = tiny_model(tokenizer)  # no EOS bias: samples run to max_new_tokens, so updates land mid-flight
    # 64 tokens per forward: prompts are prefilled a few at a time, so groups finish at staggered steps and the
    # prefetched ones are still in flight when the first two are taken (with one big prefill all finish together).
    ctl = controller(model, tokenizer, max_new_tokens=48, cb={"max_batch_tokens": 64}, prefetch_depth=2)
    try:
        ctl.take(2)  # leaves prefetched groups in flight
        old = copy.deepcopy(model)
        with ctl.weight_update():
            perturb(model)
        straddling = []
        for _ in range(2):
            groups, _ = ctl.take(2)
            straddling += [
                (g, i) for g in groups for i, v in enumerate(g.versions) if v[0] == 0 and v[-1] == 1
            ]  # fmt: skip
        assert straddling, "no completion straddled the update"
        for g, i in straddling:
            tokens, recorded, versions = g.completion_ids[i], torch.tensor(g.logprobs[i]), g.versions[i]
            b = versions.index(1)  # first token sampled with the new weights
            before = logprobs_of(old, g.prompt_ids, tokens[:b])
            assert (before - recorded[:b]).abs().max() <= 1e-4
            new_only = logprobs_of(model, g.prompt_ids, tokens)
            assert (new_only[:b] - recorded[:b]).abs().max() > 1e-3, "pre-update tokens must keep old logprobs"
            after = partial_rollout_logprobs(old, model, g.prompt_ids, tokens, b)
            assert (after - recorded[b:]).abs().max() <= 1e-4
            assert (new_only[b:] - recorded[b:]).abs().max() > 1e-4, "post-update tokens saw the old KV prefix"
    finally:
        ctl.stop()


def test_engine_error_surfaces_within_seconds_and_stop_does_not_hang(model, tokenizer):
    ctl = controller(model, tokenizer)
    ctl.take(2)

    def boom(*args, **kwargs):
        raise RuntimeError("simulated engine failure")

    handle = model.model.layers[0].register_forward_pre_hook(boom)
    try:
        start = time.monotonic()
        with pytest.raises((GenerationError, EngineDiedError)):
            for _ in range(5):
                ctl.take(2)
        assert time.monotonic() - start < 10
    finally:
        handle.remove()
        start = time.monotonic()
        ctl.stop()
        ctl.stop()
        assert time.monotonic() - start < 10


def test_async_config_validation():
    def make(**kw):
        return GRPOConfig(output_dir="/tmp/trl_cb_test", report_to=[], use_cpu=True, **kw)

    with pytest.raises(ValueError, match="needs use_transformers_continuous_batching"):
        make(async_generation=True)
    with pytest.raises(ValueError, match="needs cb_importance_sampling_correction=True"):
        make(async_generation=True, use_transformers_continuous_batching=True, cb_importance_sampling_correction=False)
    with pytest.raises(ValueError, match=">= 0"):
        make(async_generation=True, use_transformers_continuous_batching=True, max_staleness=-1)


def test_async_rejects_eager_attention(model, tokenizer):
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="sdpa or flash"):
        controller(model, tokenizer)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_trainer_async_is_exact_without_updates_and_logs_every_metric(kind, tokenizer, tmp_path):
    """lr=0: weights never change, so behaviour logprobs must equal TRL's training logprobs even though samples
    were generated across step boundaries (the engine never runs a forward alongside the trainer's)."""
    trainer = make_trainer(
        kind, tokenizer, tmp_path, async_generation=True, max_steps=3, learning_rate=0.0, max_completion_length=16
    )
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 3
    names = {f"async/{k}" for k in vars(AsyncMetrics())}
    for entry in logs:
        assert names <= set(entry), names - set(entry)
        assert entry["sampling/sampling_logp_difference/max"] <= 1e-4
    assert max(e["async/staleness_max"] for e in logs) <= 2
    assert logs[-1]["async/policy_version"] == 2
    assert trainer._cb_async is None and trainer._cb_generator is None


def test_trainer_async_learns_with_updates(tokenizer, tmp_path):
    trainer = make_trainer("grpo", tokenizer, tmp_path, async_generation=True, max_steps=3, max_completion_length=16)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert all(math.isfinite(e["loss"]) for e in logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_stop_with_requests_in_flight_finishes_them_cleanly(tokenizer):
    """`stop` flushes in-flight requests (`destroy` generates them to the end): those forwards must still run with the
    engine's attention, i.e. the training implementation is restored only after the engine has stopped."""
    from trl_cb import _upstream
    from trl_cb.tiny import tiny_model

    model = tiny_model(tokenizer)
    ctl = controller(model, tokenizer, max_new_tokens=48, cb={"max_batch_tokens": 64}, prefetch_depth=2)
    manager = ctl._manager
    ctl.take(2)  # leaves prefetched groups in flight
    ctl.stop()
    assert _upstream.engine_fatal_error(manager) is None
    assert model.config._attn_implementation == "sdpa"
